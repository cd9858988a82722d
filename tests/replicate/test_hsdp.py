"""``matrixfsdp.replicate`` on HSDP meshes ``(dp_replicate, dp_shard)``, ``repeat`` and ``split``.

Buckets are planned within ``dp_shard``; the engine's reducer combines the replicas after each
bucket's in-replica reduce-scatter. Checked against DDP over all ``R * S`` ranks and against one
process on the whole batch: the gradients directly, on exactly the ranks that step them (every
replica's owner under ``repeat``, the step replica's owner alone under ``split``), the losses and
the parameters after the step replicas' values travelled back; ``step()`` makes no collective;
optimizer state lives where the parameter is stepped; checkpoints move between HSDP and flat
``replicate`` and ``fully_shard`` bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import matrixfsdp
from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch
from matrixfsdp.placement.owner import owner_of
from replicate.test_front_end import BATCH, BUCKET, KW, _owned_state as _state_by_fqn, _train  # the flat tests' setup



def _mesh(R, S):
    if R == 1:
        return init_device_mesh("cpu", (S,), mesh_dim_names=("dp_shard",))
    return init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))


def _replicate(model, R, S, mode, stage=2, policy="alpha_balanced"):
    mesh = _mesh(R, S)
    plan = matrixfsdp.plan_owners(model, mesh, policy=policy, elementwise="owned", bucket_numel=BUCKET,
                                  replica_step=mode)
    return matrixfsdp.replicate(model, mesh=mesh, plan=plan, stage=stage)


def _use_extra(step, rank):
    # step 0: nobody uses the gated projection; step 1: only rank 0; then everyone
    return step >= 2 or (step == 1 and rank == 0)


def hsdp_parity(R: int, S: int, mode: str, stage: int, steps: int = 4) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    one = copy.deepcopy(model)  # one process, the whole batch
    _replicate(model, R, S, mode, stage)
    opt = matrixfsdp.optim.Muon(model, **KW)
    ddp_opt, one_opt = matrixfsdp.optim.Muon(ddp.module, **KW), matrixfsdp.optim.Muon(one, **KW)
    names = dict(model.named_parameters())
    ddp_p, one_p = dict(ddp.module.named_parameters()), dict(one.named_parameters())
    per = BATCH // W
    out = {"grad_ddp": 0.0, "grad_one": 0.0, "grad_max": 0.0, "loss": 0.0, "step_calls": 0,
           "none_mismatch": [], "stray_grads": [], "stepped": set()}
    counters = [model.comm_counter()] + ([model.comm_counter("replicate")] if R > 1 else [])
    for step in range(steps):
        x, y = make_batch(cfg, step, BATCH)
        sl = slice(rank * per, (rank + 1) * per)
        loss = model.loss(x[sl], y[sl], use_extra=_use_extra(step, rank))
        loss.backward()
        o = ddp(x[sl], use_extra=_use_extra(step, rank))
        F.cross_entropy(o.reshape(-1, o.shape[-1]), y[sl].reshape(-1)).backward()
        one_loss = sum(one.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per], use_extra=_use_extra(step, r))
                       for r in range(W)) / W
        one_loss.backward()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out["loss"] = max(out["loss"], abs(g.item() / W - one_loss.item()))
        for n, p in names.items():
            info = owner_of(p)
            if info is None:  # frozen
                continue
            if not info.is_local:
                if p.grad is not None:
                    out["stray_grads"].append((step, n))
                continue
            out["stepped"].add(n)
            q, o1 = ddp_p[n], one_p[n]
            if (p.grad is None) != (q.grad is None):
                out["none_mismatch"].append((step, n, p.grad is None))
                continue
            if p.grad is not None:
                out["grad_ddp"] = max(out["grad_ddp"], (p.grad - q.grad).abs().max().item())
                out["grad_one"] = max(out["grad_one"], (p.grad - o1.grad).abs().max().item())
                out["grad_max"] = max(out["grad_max"], q.grad.abs().max().item())
        if step == 1:
            model.state_dict()  # a settle between backward and step(): nothing moved yet
        for c in counters:
            c.reset()
        opt.step()
        out["step_calls"] += sum(c.total_calls for c in counters)
        if step == 2:
            # a settle after step(): only some ranks' parameters moved (under split, the step
            # replicas' owners); every rank must agree to gather, or some would hang
            model.state_dict()
        for o_ in (ddp_opt, one_opt):
            o_.step()
        for o_ in (opt, ddp_opt, one_opt):
            o_.zero_grad()
    model.sync_params()
    out["param_ddp"] = max((p - ddp_p[n]).abs().max().item() for n, p in names.items())
    out["param_one"] = max((p - one_p[n]).abs().max().item() for n, p in names.items())
    out["ddp_one"] = max((ddp_p[n] - one_p[n]).abs().max().item() for n in names)
    out["moved"] = max((p - q).abs().max().item() for (n, p), q in
                       zip(names.items(), TinyDecoder(cfg, seed=0).parameters()))
    out["state"] = sorted(n for n, p in names.items() if opt.state.get(p))
    out["stepped"] = sorted(out["stepped"])
    out["coord"] = (dist.get_rank() // S, dist.get_rank() % S)
    return out


@pytest.mark.parametrize("R, S", [(2, 2), (2, 3)])
@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_matches_ddp_and_one_process(R, S, mode):
    res = get_pool(R * S).run(hsdp_parity, R, S, mode, 2)
    for r in res:
        assert not r["none_mismatch"] and not r["stray_grads"], r
        assert r["step_calls"] == 0  # the optimizer step never communicates
        assert r["state"] == r["stepped"]  # state exactly where the parameter is stepped
        # the same sums in another order than DDP's one all-reduce: float32 rounding
        assert r["grad_ddp"] <= 1e-6 * r["grad_max"] + 1e-7 and r["grad_max"] > 1e-4, r
        assert r["grad_one"] <= 1e-6 * r["grad_max"] + 1e-7, r
        assert r["loss"] <= 1e-6, r
        # Newton-Schulz amplifies the reduction order's last bits: as close to one process as DDP is
        assert r["param_ddp"] <= 1e-6 and r["moved"] > 1e-3, r
        assert r["param_one"] <= 2 * r["ddp_one"] + 1e-6, r
    # every parameter is stepped by exactly one owner per replica (repeat) or one rank (split)
    copies: dict[str, list] = {}
    for r in res:
        for n in r["stepped"]:
            copies.setdefault(n, []).append(r["coord"])
    want = R if mode == "repeat" else 1
    assert copies and all(len(c) == want for c in copies.values()), copies
    if mode == "split":  # the steps are spread over the replicas
        assert {c[0][0] for c in copies.values()} == set(range(R))


def test_split_and_repeat_move_the_same_gradient_bytes_in_backward():
    """On (2, 2): the in-replica reduce-scatter is the flat one's; ``split`` sends each owned
    gradient across the replicas once (a reduce-scatter), ``repeat`` all-reduces it."""
    res = {m: get_pool(4).run(_backward_bytes, 2, 2, m) for m in ("repeat", "split")}
    for m, rs in res.items():
        for r in rs:
            assert r["shard"]["reduce_scatter"] > 0 and r["replica"].get("all_reduce", 0) > 0, (m, r)
    split_rs = sum(r["replica"].get("reduce_scatter", 0) for r in res["split"])
    assert split_rs > 0
    assert sum(r["replica"].get("all_reduce", 0) for r in res["split"]) < \
        sum(r["replica"]["all_reduce"] for r in res["repeat"])


def _backward_bytes(R, S, mode):
    cfg = TinyConfig()
    model = _replicate(TinyDecoder(cfg, seed=0), R, S, mode)
    x, y = make_batch(cfg, 0, BATCH)
    per = BATCH // (R * S)
    sl = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    model.loss(x[sl], y[sl]).backward()
    shard, replica = model.comm_counter(), model.comm_counter("replicate")
    shard.reset()
    replica.reset()
    model.loss(x[sl], y[sl]).backward()
    return {"shard": dict(shard.bytes_sent), "replica": dict(replica.bytes_sent)}


# ==================================================================================== checkpoints
def w_ckpt(root: str, kind: str, R: int, S: int, mode: str, load: str | None, save: str | None) -> dict:
    """Build ``kind`` on an (R, S) mesh (R=1: flat), optionally load ``load``, train a step if it
    will save, save to ``save``; report parameters and this rank's optimizer state."""
    import matrixfsdp.checkpoint as mckpt

    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=7 if load else 0)  # a load must overwrite these values
    if kind == "replicate":
        _replicate(model, R, S, mode)
    else:
        mesh = _mesh(R, S)
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,), replica_step=mode)
        for b in model.blocks:
            matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, **KW)
    if load:
        mckpt.load(f"{root}/{load}", model, opt)
    out = {"params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                      for n, p in model.named_parameters()},
           "state": _state_by_fqn(model, opt) if kind == "replicate" else {},
           "local": {n: owner_of(p).is_local for n, p in model.named_parameters() if owner_of(p)}}
    if save:
        _train(model, opt, cfg, 2 if not load else 1, start=3)
        mckpt.save(f"{root}/{save}", model, opt)
    return out


def _reference(path):
    """The checkpoint loaded into one process: every parameter and state tensor."""
    import matrixfsdp.checkpoint as mckpt

    model = TinyDecoder(TinyConfig(), seed=11)
    opt = matrixfsdp.optim.Muon(model, **KW)
    mckpt.load(path, model, opt)
    return {"params": {n: p.detach() for n, p in model.named_parameters()}, "state": _state_by_fqn(model, opt)}


def _check(res, ref, *, replicate_state=True):
    for r in res:
        assert all(torch.equal(v, ref["params"][n]) for n, v in r["params"].items())
        if not replicate_state:
            continue
        for f, st in r["state"].items():
            assert r["local"][f], f"{f}: state on a rank that does not step it"
            assert st.keys() == ref["state"][f].keys() and all(torch.equal(st[k], ref["state"][f][k]) for k in st), f
    if replicate_state:  # every stepped parameter got its state back
        for f in ref["state"]:
            assert any(r["local"].get(f) and f in r["state"] for r in res), f


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_checkpoints_between_hsdp_and_flat(tmp_path, mode):
    """HSDP (2, 2) replicate -> one process, flat replicate W=4 and W=2, fully_shard W=4; flat
    replicate W=2 -> HSDP (2, 2) replicate: parameters and every optimizer state tensor bitwise."""
    root = str(tmp_path)
    get_pool(4).run(w_ckpt, root, "replicate", 2, 2, mode, None, "hsdp")
    ref = _reference(f"{root}/hsdp")
    assert len(ref["state"]) > 20
    _check(get_pool(4).run(w_ckpt, root, "replicate", 1, 4, "repeat", "hsdp", None), ref)
    _check(get_pool(4).run(w_ckpt, root, "fully_shard", 1, 4, "repeat", "hsdp", None), ref, replicate_state=False)
    _check(get_pool(2).run(w_ckpt, root, "replicate", 1, 2, "repeat", "hsdp", "flat"), ref)
    ref2 = _reference(f"{root}/flat")
    _check(get_pool(4).run(w_ckpt, root, "replicate", 2, 2, mode, "flat", None), ref2)


def test_fully_shard_hsdp_checkpoint_loads_into_hsdp_replicate(tmp_path):
    root = str(tmp_path)
    get_pool(4).run(w_ckpt, root, "fully_shard", 2, 2, "split", None, "fs")
    ref = _reference(f"{root}/fs")
    _check(get_pool(4).run(w_ckpt, root, "replicate", 2, 2, "split", "fs", None), ref)


# ==================================================================================== streams
class _StreamSpy:
    """Stands in for a bucket's ``CommContext`` with named streams, recording the stream each
    engine call runs on (``None``: the compute stream). The CPU code path is kept
    (``on_device`` is false), so the calls are the real ones, in the real order."""

    on_device = False
    copy_in, gather, reduce = "copy_in", "gather", "reduce"

    def __init__(self):
        self.stack: list = [None]
        self.seen: list[tuple[str, object]] = []

    def use(self, stream):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.stack.append(stream)
            try:
                yield
            finally:
                self.stack.pop()
        return cm()

    def wrap(self, obj, name, label):
        f = getattr(obj, name)

        def spy(*a, **k):
            self.seen.append((label, self.stack[-1]))
            return f(*a, **k)
        setattr(obj, name, spy)


def stream_order(R: int, S: int, mode: str) -> dict:
    """[Note: streams] in engine/reducer.py for ``replicate``: each gradient's copy into its
    bucket on the compute stream, every reduction (and its replica phase) on the reduce stream,
    every parameter gather (and the step replicas' exchange) on the gather stream."""
    cfg = TinyConfig()
    model = _replicate(TinyDecoder(cfg, seed=0), R, S, mode)
    opt = matrixfsdp.optim.Muon(model, **KW)
    spy = _StreamSpy()
    colls = {}
    for b in model._matrixfsdp_state.buckets:
        b.comm = b.reducer.comm = spy
        spy.wrap(b.reducer, "put", "copy-in")
        for coll in [b.coll] + ([b.replicas.coll] if b.replicas is not None else []):
            colls[id(coll)] = coll
    for coll in colls.values():
        for name in ("reduce_scatter_segments", "all_reduce", "all_gather_inplace"):
            spy.wrap(coll, name, name)
    rank, W = dist.get_rank(), dist.get_world_size()
    per = BATCH // W
    for step in range(2):
        x, y = make_batch(cfg, step, BATCH)
        model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], use_extra=True).backward()
        opt.step()
        opt.zero_grad()
    return {"seen": spy.seen, "n_buckets": len(model._matrixfsdp_state.buckets)}


@pytest.mark.parametrize("R, S, mode", [(1, 2, "repeat"), (2, 2, "split")])
def test_streams(R, S, mode):
    want = {"copy-in": None, "reduce_scatter_segments": "reduce", "all_reduce": "reduce",
            "all_gather_inplace": "gather"}
    for r in get_pool(R * S).run(stream_order, R, S, mode):
        kinds = {k for k, _ in r["seen"]}
        assert {"copy-in", "reduce_scatter_segments", "all_gather_inplace"} <= kinds, kinds
        if R > 1:
            assert "all_reduce" in kinds
        wrong = [(k, s) for k, s in r["seen"] if want[k] != s]
        assert not wrong, wrong[:5]
        # the second step's gathers come after the first backward's reductions
        n_rs = sum(1 for k, _ in r["seen"] if k == "reduce_scatter_segments")
        assert n_rs >= 2 * r["n_buckets"]
