"""ZeRO-1/2 on alpha-balanced buckets (``matrixfsdp.replicate``, issue 12) against DDP with the
same optimizer: gradients compared directly, parameters after 10 steps, collectives counted."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import get_pool
from _models import TinyConfig, TinyDecoder, make_batch

import matrixfsdp
from matrixfsdp.placement.owner import owner_of

BATCH = 12
KW = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3, weight_decay=0.01)
BUCKET = 40_000  # several buckets on the tiny model, the last one uneven


def _setup(stage, policy="alpha_balanced", alpha=0.5, seed=0, **kw):
    W = dist.get_world_size()
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=seed)
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    mesh = init_device_mesh("cpu", (W,))
    plan = matrixfsdp.plan_owners(model, mesh, policy=policy, alpha=alpha, elementwise="owned",
                                  bucket_numel=BUCKET)
    matrixfsdp.replicate(model, mesh=mesh, plan=plan, stage=stage, **kw)
    return cfg, model, ref


def _use_extra(step, rank):
    # step 0: nobody uses the gated projection; step 1: only rank 0; then everyone
    return step >= 2 or (step == 1 and rank == 0)


def ddp_parity(stage: int, steps: int, policy: str, alpha: float) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref = _setup(stage, policy, alpha)
    opt, ref_opt = matrixfsdp.optim.Muon(model, **KW), matrixfsdp.optim.Muon(ref.module, **KW)
    names = dict(model.named_parameters())
    ref_p = dict(ref.module.named_parameters())
    out = {"grad_diff": 0.0, "grad_max": 0.0, "non_owner_grads": 0, "none_mismatch": [], "loss_diff": 0.0}
    per = BATCH // W
    counter = model.comm_counter()
    for step in range(steps):
        x, y = make_batch(cfg, step, BATCH)
        sl = slice(rank * per, (rank + 1) * per)
        ue = _use_extra(step, rank)
        counter.reset()
        loss = model.loss(x[sl], y[sl], use_extra=ue)
        loss.backward()
        ref_out = ref(x[sl], use_extra=ue)
        ref_loss = torch.nn.functional.cross_entropy(ref_out.reshape(-1, ref_out.shape[-1]), y[sl].reshape(-1))
        ref_loss.backward()
        out["loss_diff"] = max(out["loss_diff"], (loss - ref_loss).abs().item())
        for n, p in names.items():
            q = ref_p[n]
            info = owner_of(p)
            if info is None:  # frozen
                continue
            if not info.is_local:
                out["non_owner_grads"] += p.grad is not None
                continue
            if (p.grad is None) != (q.grad is None):
                out["none_mismatch"].append((step, n, p.grad is None))
                continue
            if p.grad is not None:
                out["grad_diff"] = max(out["grad_diff"], (p.grad - q.grad).abs().max().item())
                out["grad_max"] = max(out["grad_max"], q.grad.abs().max().item())
        after_bwd = counter.snapshot()
        counter.reset()
        opt.step()
        out.setdefault("step_calls", 0)
        out["step_calls"] += counter.total_calls
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out[f"calls_{step}"] = after_bwd["calls"]
    model.sync_params()
    out["param_diff"] = max((p - ref_p[n]).abs().max().item() for n, p in names.items())
    out["moved"] = max((p - q).abs().max().item() for (n, p), q in
                       zip(names.items(), TinyDecoder(cfg, seed=0).parameters()))
    out["n_buckets"] = len(model.owner_plan.meta and dict(model.owner_plan.meta)["buckets"])
    out["state_params"] = sorted(n for n, p in names.items() if p in opt.state)
    out["owned"] = sorted(n for n, p in names.items() if owner_of(p) and owner_of(p).is_local)
    return out


@pytest.mark.parametrize("W,stage", [(2, 1), (2, 2), (3, 2), (4, 1)])
def test_matches_ddp(W, stage):
    steps = 10 if W == 2 else 4
    res = get_pool(W).run(ddp_parity, stage, steps, "alpha_balanced", 0.5)
    for r in res:
        assert not r["none_mismatch"], r["none_mismatch"]
        assert r["non_owner_grads"] == 0
        assert r["step_calls"] == 0  # the optimizer step never communicates
        assert r["state_params"] == r["owned"]  # state only for this rank's parameters
        tol = 0.0 if W == 2 else 1e-6
        assert r["grad_diff"] <= tol and r["grad_max"] > 1e-4, r
        assert r["loss_diff"] <= tol, r
        assert r["param_diff"] <= (0.0 if W == 2 else 1e-6) and r["moved"] > 1e-3, r
    owned = sorted(n for r in res for n in r["owned"])
    assert len(owned) == len(set(owned))  # every parameter has exactly one owner


def _ref_grads_equal(model, ref, tol):
    """Owners' gradients against DDP's (every rank holds DDP's); non-owners must have none."""
    worst, bad = 0.0, []
    ref_p = dict(ref.module.named_parameters())
    for n, p in model.named_parameters():
        info, q = owner_of(p), ref_p[n]
        if info is None:
            continue
        if not info.is_local:
            if p.grad is not None:
                bad.append(("non-owner grad", n))
            continue
        if (p.grad is None) != (q.grad is None):
            bad.append(("none mismatch", n))
        elif p.grad is not None:
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst, bad


def accumulation_and_clipping(stage: int, spelling: str) -> dict:
    """Two micro-batches per step (the first without gradient sync), clipping across ranks."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref = _setup(stage)
    opt, ref_opt = matrixfsdp.optim.Muon(model, **KW), matrixfsdp.optim.Muon(ref.module, **KW)
    per = BATCH // W
    out = {"grad_diff": 0.0, "bad": [], "norm_diff": 0.0, "calls": []}
    counter = model.comm_counter()
    for step in range(3):
        counter.reset()
        for micro in range(2):
            x, y = make_batch(cfg, 10 * step + micro, BATCH)
            sl = slice(rank * per, (rank + 1) * per)
            last = micro == 1
            if spelling == "no_sync":
                ctx, rctx = (model.no_sync(), ref.no_sync()) if not last else (contextlib.nullcontext(),) * 2
            else:
                model.set_requires_gradient_sync(last)
                ctx, rctx = contextlib.nullcontext(), (ref.no_sync() if not last else contextlib.nullcontext())
            with ctx:
                model.loss(x[sl], y[sl]).backward()
            with rctx:
                o = ref(x[sl])
                torch.nn.functional.cross_entropy(o.reshape(-1, o.shape[-1]), y[sl].reshape(-1)).backward()
        out["calls"].append(dict(counter.calls))
        g, bad = _ref_grads_equal(model, ref, 0)
        out["grad_diff"] = max(out["grad_diff"], g)
        out["bad"] += bad
        norm = matrixfsdp.clip_grad_norm_(model.parameters(), 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.module.parameters(), 0.05)
        out["norm_diff"] = max(out["norm_diff"], (norm - ref_norm).abs().item())
        out["norm"] = ref_norm.item()
        g, bad = _ref_grads_equal(model, ref, 0)
        out["clipped_grad_diff"] = g
        out["bad"] += bad
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    model.sync_params()
    ref_p = dict(ref.module.named_parameters())
    out["param_diff"] = max((p - ref_p[n]).abs().max().item() for n, p in model.named_parameters())
    return out


@pytest.mark.parametrize("spelling", ["no_sync", "set_requires_gradient_sync"])
def test_gradient_accumulation_and_clipping_match_ddp(spelling):
    for r in get_pool(2).run(accumulation_and_clipping, 2, spelling):
        assert not r["bad"], r["bad"]
        assert r["grad_diff"] <= 1e-7 and r["clipped_grad_diff"] <= 1e-7, r
        assert r["norm"] > 0.05 and r["norm_diff"] <= 1e-6, r  # clipping was active
        assert r["param_diff"] <= 1e-6, r
        # the micro-batch without sync communicates nothing: one reduce-scatter per bucket per step
        assert all(c == r["calls"][1] for c in r["calls"][1:]) and "reduce_scatter" in r["calls"][0]


def mixed_precision() -> dict:
    """bf16 autocast with bf16 gradient reduction, against DDP with a bf16 compression hook (torch's
    own ``bf16_compress_hook`` refuses gloo; this is the same computation)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref = _setup(2, reduce_dtype=torch.bfloat16)

    def bf16_hook(state, bucket):
        buf = bucket.buffer()
        c = buf.to(torch.bfloat16).div_(W)

        def back(fut):
            buf.copy_(fut.value()[0])
            return buf
        return dist.all_reduce(c, async_op=True).get_future().then(back)

    ref.register_comm_hook(None, bf16_hook)
    opt, ref_opt = matrixfsdp.optim.Muon(model, **KW), matrixfsdp.optim.Muon(ref.module, **KW)
    per = BATCH // W
    out = {"grad_diff": 0.0, "bad": []}
    for step in range(3):
        x, y = make_batch(cfg, step, BATCH)
        sl = slice(rank * per, (rank + 1) * per)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(x[sl], y[sl])
            o = ref(x[sl])
            ref_loss = torch.nn.functional.cross_entropy(o.float().reshape(-1, o.shape[-1]), y[sl].reshape(-1))
        loss.backward()
        ref_loss.backward()
        g, bad = _ref_grads_equal(model, ref, 0)
        out["grad_diff"] = max(out["grad_diff"], g)
        out["bad"] += bad
        out["grad_dtype"] = str(next(p.grad.dtype for p in model.parameters() if p.grad is not None))
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    model.sync_params()
    ref_p = dict(ref.module.named_parameters())
    out["param_diff"] = max((p - ref_p[n]).abs().max().item() for n, p in model.named_parameters())
    return out


def test_mixed_precision_matches_ddp_bf16_hook():
    for r in get_pool(2).run(mixed_precision):
        assert not r["bad"], r["bad"]
        assert r["grad_dtype"] == "torch.float32"
        # bf16 reduction: both sides round the same products (the division by W=2 is exact)
        assert r["grad_diff"] == 0.0, r
        assert r["param_diff"] <= 1e-6, r


def autograd_grad_and_host_syncs() -> dict:
    """torch.autograd.grad leaves .grad alone and communicates nothing; forward and backward of a
    step where every parameter is used make no host synchronization."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref = _setup(2)
    counter = model.comm_counter()
    x, y = make_batch(cfg, 0, BATCH)
    counter.reset()
    loss = model.loss(x, y, use_extra=True)
    (gx,) = torch.autograd.grad(loss, [model.blocks[0].up.weight])
    out = {"grad_calls": counter.total_calls, "grads_none": all(p.grad is None for p in model.parameters()),
           "gx_norm": gx.norm().item()}
    # host syncs: patch the tensor methods that read device memory into Python
    import matrixfsdp._replicate.state as rep

    calls = []
    originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy")}

    def spy(name):
        orig = originals[name]

        def f(self, *a, **k):
            import traceback

            if any("matrixfsdp" in fr.filename for fr in traceback.extract_stack()[:-1]):
                calls.append(name)
            return orig(self, *a, **k)
        return f

    from matrixfsdp.engine import reducer as engine_reduce

    opt = matrixfsdp.optim.Muon(model, **KW)
    # steps 0, 1: everything used; 2: the gated projection unused everywhere (its owner reads the
    # summed flags once); 3: the same with set_find_unused_parameters(False): no read
    owns_extra = any(owner_of(p).is_local for n, p in model.named_parameters() if ".extra." in n)
    per_step, reads = [], []
    for step, use_extra in enumerate((True, True, False, False)):
        if step == 3:
            model.set_find_unused_parameters(False)
        calls.clear()
        before = engine_reduce.host_reads[0]
        for n in originals:
            setattr(torch.Tensor, n, spy(n))
        try:
            model.loss(x, y, use_extra=use_extra).backward()
        finally:
            for n, f in originals.items():
                setattr(torch.Tensor, n, f)
        per_step.append(list(calls))
        reads.append(engine_reduce.host_reads[0] - before)
        opt.step(); opt.zero_grad()
    model.set_find_unused_parameters(True)
    out["host_syncs"] = per_step
    out["reads"] = reads
    out["owns_extra"] = owns_extra
    return out


def test_autograd_grad_untouched_and_no_host_sync():
    for r in get_pool(2).run(autograd_grad_and_host_syncs):
        assert r["grad_calls"] == 0 and r["grads_none"] and r["gx_norm"] > 0, r
        syncs, reads = r["host_syncs"], r["reads"]
        assert syncs[0] == syncs[1] == syncs[3] == [] and reads[0] == reads[1] == reads[3] == 0, r
        # the owner of the unused parameter reads the flags once ([Note: usage-flag host read])
        assert (syncs[2], reads[2]) == ((["tolist"], 1) if r["owns_extra"] else ([], 0)), r


def bytes_and_state() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref = _setup(2, policy="alpha_balanced", alpha=0.0)
    opt = matrixfsdp.optim.Muon(model, **KW)
    ref_opt = matrixfsdp.optim.Muon(ref.module, **KW)
    counter = model.comm_counter()
    x, y = make_batch(cfg, 0, BATCH)
    model.loss(x, y, use_extra=True).backward()
    o = ref(x, use_extra=True)
    torch.nn.functional.cross_entropy(o.reshape(-1, o.shape[-1]), y.reshape(-1)).backward()
    opt.step(); ref_opt.step()
    counter.reset()
    model.loss(x, y, use_extra=True).backward()  # a full step: gathers, then reductions
    sent = sum(counter.bytes_sent.values())
    nbytes = lambda st: sum(v.nbytes for s in st.values() for v in s.values() if torch.is_tensor(v))
    trainable = [p for p in model.parameters() if p.requires_grad]
    largest = max(nbytes({0: ref_opt.state[q]}) for q in ref.module.parameters() if q in ref_opt.state)
    return {"sent": sent, "calls": dict(counter.calls), "numel": sum(p.numel() for p in trainable),
            "n_params": len(trainable), "state": nbytes(opt.state), "ddp_state": nbytes(ref_opt.state),
            "largest_state": largest, "buckets": len(dict(model.owner_plan.meta)["buckets"]),
            # rank r's gradient interval of a bucket: its gradients and flags, then zeros up to a
            # multiple of 4 fp32 elements ([Note: aligned reduce chunks]), derived from the layout
            "pad": sum((-(n + c)) % 4 for b in model._matrixfsdp_state.buckets
                       for n, c in zip(b.layout.param_splits, b.layout.counts)),
            "dtypes": sorted({str(b.reduce_dtype) for b in model._matrixfsdp_state.buckets})}


@pytest.mark.parametrize("W", [2, 4])
def test_bytes_equal_ddp_allreduce_and_state_is_sharded(W):
    res = get_pool(W).run(bytes_and_state)
    r0 = res[0]
    # a ring all-reduce moves 2 (W-1)/W N elements per rank; reduce-scatter + all-gather move the
    # same in total (uneven intervals shift bytes between ranks), plus one usage flag per parameter
    # and the alignment padding after each rank's flags, exactly
    total = sum(r["sent"] for r in res)
    assert r0["dtypes"] == ["torch.float32"], r0
    ddp_total = W * 2 * (W - 1) // W * r0["numel"] * 4
    assert total == ddp_total + (W - 1) * (r0["n_params"] + r0["pad"]) * 4, (total, ddp_total, r0["pad"])
    assert 0 <= r0["pad"] < 4 * W * r0["buckets"]
    print(f"\n[replicate W={W}] sent {total} B = DDP {ddp_total} + flags {(W - 1) * r0['n_params'] * 4}"
          f" + alignment {(W - 1) * r0['pad'] * 4}")
    for r in res:
        assert r["calls"] == {"all_gather": r["buckets"], "reduce_scatter": r["buckets"]}, r
        # alpha=0: even split of every bucket; state <= DDP's / W + the largest parameter's state
        assert r["state"] <= r["ddp_state"] / W + r["largest_state"], r
    assert sum(r["state"] for r in res) == r0["ddp_state"]


# ==================================================================================== checkpoints
def _train(model, opt, cfg, steps, start=0):
    rank, W = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    per = BATCH // W
    for step in range(start, start + steps):
        x, y = make_batch(cfg, step, BATCH)
        model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], use_extra=True).backward()
        opt.step()
        opt.zero_grad()


def _owned_state(model, opt):
    """This rank's optimizer state by fqn (local tensors), and its parameters."""
    from matrixfsdp.placement.owned_tensor import local_tensor

    fqn = {id(p): n for n, p in model.named_parameters()}
    state = {fqn[id(p)]: {k: local_tensor(v).clone() for k, v in st.items() if torch.is_tensor(v)}
             for p, st in opt.state.items() if st}
    return {k: v for k, v in state.items() if all(t.numel() or t.ndim == 0 for t in v.values())}


def w_save_replicate(root: str) -> str:
    import matrixfsdp.checkpoint as mckpt

    cfg, model, _ = _setup(2)
    opt = matrixfsdp.optim.Muon(model, **KW)
    _train(model, opt, cfg, 3)
    mckpt.save(f"{root}/zero", model, opt)
    # torch's full optimizer state dict: the same keys on every rank, the owners' values
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f: {k: v.detach().clone() for k, v in st.items()} for f, st in full["state"].items()}


def w_load(root: str, kind: str, src: str) -> dict:
    """Load checkpoint ``src`` into a fresh ``kind`` model at this world size; report its state."""
    import matrixfsdp.checkpoint as mckpt
    from _models import Block

    W = dist.get_world_size()
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=7)  # other values: the load must overwrite them
    mesh = init_device_mesh("cpu", (W,))
    if kind == "replicate":
        matrixfsdp.replicate(model, mesh=mesh, plan=matrixfsdp.plan_owners(
            model, mesh, policy="naive_static", elementwise="owned", bucket_numel=BUCKET))
    elif kind == "fully_shard":
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
        for b in model.blocks:
            matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, **KW)
    if kind == "replicate" and src == "zero":  # the standard DCP path
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=f"{root}/{src}")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        mckpt.load(f"{root}/{src}", model, opt)
    out = {"state": _owned_state(model, opt),
           "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                      for n, p in model.named_parameters()}}
    if kind == "fully_shard":  # and write a checkpoint of the matrixfsdp ZeRO-3 layout
        _train(model, opt, cfg, 1, start=3)
        mckpt.save(f"{root}/zero3", model, opt)
    return out


def _plain_reference(path):
    import matrixfsdp.checkpoint as mckpt

    model = TinyDecoder(TinyConfig(), seed=11)
    opt = matrixfsdp.optim.Muon(model, **KW)
    mckpt.load(path, model, opt)
    return {"state": _owned_state(model, opt), "params": {n: p.detach() for n, p in model.named_parameters()}}


def _check_same(res, ref):
    merged = {}
    for r in res:
        for f, st in r["state"].items():
            assert f not in merged, f"{f} has state on two ranks"
            merged[f] = st
        assert all(torch.equal(v, ref["params"][n]) for n, v in r["params"].items())
    assert merged.keys() == ref["state"].keys(), (sorted(merged), sorted(ref["state"]))
    for f, st in merged.items():
        assert st.keys() == ref["state"][f].keys() and all(torch.equal(st[k], ref["state"][f][k]) for k in st), f


def test_checkpoints_reshard_and_convert(tmp_path):
    """replicate W=2 -> one process, replicate W=3 (standard DCP path) and W=4, matrixfsdp ZeRO-3
    W=2; ZeRO-3 -> replicate W=3: parameters and every optimizer state tensor bitwise, each state on
    exactly one rank."""
    root = str(tmp_path)
    full = get_pool(2).run(w_save_replicate, root)
    ref = _plain_reference(f"{root}/zero")
    assert len(ref["state"]) > 20
    for r in full:
        assert r.keys() == ref["state"].keys()
        for f, st in r.items():
            assert all(torch.equal(st[k], ref["state"][f][k]) for k in st), f
    _check_same(get_pool(3).run(w_load, root, "replicate", "zero"), ref)
    _check_same(get_pool(4).run(w_load, root, "replicate", "zero"), ref)
    res = get_pool(2).run(w_load, root, "fully_shard", "zero")
    merged = {}
    for r in res:  # fully_shard: owned state on owners, even (embedding, head) state in row shards
        for f, st in r["state"].items():
            merged.setdefault(f, []).append(st)
    for f, sts in merged.items():
        for k in ref["state"][f]:
            got = torch.cat([s[k] for s in sts]) if ref["state"][f][k].ndim else sts[0][k]
            assert torch.equal(got, ref["state"][f][k]), (f, k)
    ref3 = _plain_reference(f"{root}/zero3")
    _check_same(get_pool(3).run(w_load, root, "replicate", "zero3"), ref3)


# ==================================================================================== robustness
class _Boom(Exception):
    pass


def exception_mid_backward() -> dict:
    """An exception escapes a backward after some buckets were reduced; the next iterations equal
    those of a run that never saw the failed one."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, _ = _setup(2, seed=0)
    _, clean, _ = _setup(2, seed=0)
    opts = [matrixfsdp.optim.Muon(m, **KW) for m in (model, clean)]
    fail = {"on": False}

    def arm(mod, args, out):
        if fail["on"] and out.requires_grad:
            out.register_hook(lambda g: (_ for _ in ()).throw(_Boom("mid-backward")))
    model.blocks[0].register_forward_hook(arm)
    counter = model.comm_counter()
    per = BATCH // W
    sl = slice(rank * per, (rank + 1) * per)
    out = {}
    for step in range(4):
        x, y = make_batch(cfg, step, BATCH)
        if step == 1:
            fail["on"] = True
            counter.reset()
            try:
                model.loss(x[sl], y[sl], use_extra=True).backward()
            except _Boom:
                out["launched_before_failure"] = counter.calls.get("reduce_scatter", 0)
            fail["on"] = False
            opts[0].zero_grad()
        for m, o in zip((model, clean), opts):
            m.loss(x[sl], y[sl], use_extra=True).backward()
            o.step()
            o.zero_grad()
    model.sync_params(); clean.sync_params()
    out["diff"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), clean.parameters()))
    return out


def test_exception_mid_backward_then_training_continues():
    for r in get_pool(2).run(exception_mid_backward):
        assert r["launched_before_failure"] >= 1, r  # the failure hit after reductions were issued
        assert r["diff"] == 0.0, r


def bad_input(case: str) -> str:
    W = dist.get_world_size()
    model = TinyDecoder(TinyConfig(), seed=0)
    mesh = init_device_mesh("cpu", (W,))
    try:
        if case == "stage":
            matrixfsdp.replicate(model, mesh=mesh, stage=3)
        elif case == "even":
            matrixfsdp.replicate(model, mesh=mesh, plan=matrixfsdp.plan_owners(model, mesh, elementwise="even"))
        elif case == "world":
            matrixfsdp.replicate(model, mesh=mesh, plan=matrixfsdp.plan_owners(model, W + 1, elementwise="owned"))
        elif case == "twice":
            matrixfsdp.replicate(model, mesh=mesh)
            matrixfsdp.replicate(model, mesh=mesh)
        elif case == "sharded":
            matrixfsdp.fully_shard(model, mesh=mesh)
            matrixfsdp.replicate(model, mesh=mesh)
        elif case == "layouts_differ":
            matrixfsdp.replicate(model, mesh=mesh, stage=1 + dist.get_rank())
        elif case == "plans_differ":
            plan = matrixfsdp.plan_owners(model, mesh, policy="alpha_balanced", elementwise="owned",
                                          alpha=0.5 if dist.get_rank() == 0 else 1.0, bucket_numel=BUCKET)
            matrixfsdp.replicate(model, mesh=mesh, plan=plan)
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("case,expected", [
    ("stage", "ValueError: matrixfsdp.replicate: stage must be 1 or 2, got stage=3"),
    ("even", "ValueError: matrixfsdp.replicate: every parameter must be owned whole by one rank"),
    ("world", "ValueError: matrixfsdp.replicate: the plan was built for world_size=3 but the mesh has 2 ranks"),
    ("twice", "ValueError: matrixfsdp.replicate: the module is already managed by matrixfsdp.replicate"),
    ("sharded", "ValueError: matrixfsdp.replicate: submodule '<root>' is already sharded by fully_shard"),
    ("plans_differ", "RuntimeError: matrixfsdp.replicate: the plan differs across ranks"),
    ("layouts_differ", "ValueError: matrixfsdp.replicate: the ranks disagree on the bucket layout"),
])
def test_errors_on_every_rank(case, expected):
    for msg in get_pool(2).run(bad_input, case):
        assert msg.startswith(expected), msg


# ==================================================================================== Hugging Face
def hf_vs_ddp(tied: bool, checkpointing: bool) -> dict:
    import warnings

    from integrations.test_huggingface import BATCH as HB, build, tokens

    rank, W = dist.get_rank(), dist.get_world_size()
    model, _ = build("qwen3", tied)
    ref = DDP(copy.deepcopy(model))
    matrixfsdp.replicate(model, stage=2)  # defaults: alpha-balanced buckets, default mesh
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
            ref.module.gradient_checkpointing_enable()
    model.train(); ref.train()
    opt, ref_opt = matrixfsdp.optim.Muon(model, **KW), matrixfsdp.optim.Muon(ref.module, **KW)
    per = HB // W
    out = {"grad_diff": 0.0, "bad": [], "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    for step in range(3):
        ids = tokens(step)[rank * per:(rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        ref(input_ids=ids, labels=ids).loss.backward()
        g, bad = _ref_grads_equal(model, ref, 0)
        out["grad_diff"] = max(out["grad_diff"], g)
        out["bad"] += bad
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    ids = tokens(9)[:1, :4]
    out["generate_equal"] = torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                                        ref.module.generate(ids, max_new_tokens=4, do_sample=False))
    ref_p = dict(ref.module.named_parameters())
    out["param_diff"] = max((p - ref_p[n]).abs().max().item() for n, p in model.named_parameters())
    return out


@pytest.mark.parametrize("tied,checkpointing", [(False, True), (True, False)])
def test_hugging_face_qwen3_matches_ddp(tied, checkpointing):
    pytest.importorskip("transformers")
    for r in get_pool(2).run(hf_vs_ddp, tied, checkpointing):
        assert r["tied"] == tied and not r["bad"], r
        assert r["grad_diff"] <= 1e-7 and r["param_diff"] <= 1e-6, r
        assert r["generate_equal"]


def stage_buffers(stage: int) -> dict:
    """ZeRO-1 keeps each bucket's gradient buffer for the run; ZeRO-2 frees it after the
    reduction, so a rank then holds only its own gradients."""
    from matrixfsdp._replicate import state_of

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, _ = _setup(stage)
    x, y = make_batch(cfg, 0, BATCH)
    model.loss(x, y, use_extra=True).backward()
    st = state_of(model)
    held = sum(b.grad_buf.numel() for b in st.buckets if b.grad_buf is not None)
    grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    own = sum(b.layout.param_splits[rank] for b in st.buckets)
    return {"held": held, "grads": grads, "own": own, "total": sum(b.grad_numel for b in st.buckets)}


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_keeps_and_stage_2_frees_gradient_buffers(stage):
    for r in get_pool(2).run(stage_buffers, stage):
        assert r["grads"] == r["own"], r  # .grad only on this rank's parameters, in both stages
        assert r["held"] == (r["total"] if stage == 1 else 0), r


def torch_adamw_standard_resume(root: str) -> dict:
    """torch.optim.AdamW through torch's standard DCP path: the resumed run continues exactly, and
    the state torch's loader creates for every parameter (get_state_dict's zero-gradient step)
    is dropped for parameters another rank owns at the next step (the optimizer's own pre-hook,
    registered by ``model.register_optimizer``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cfg, model, _ = _setup(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, cfg, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/adamw")
    _train(model, opt, cfg, 2, start=2)
    _, fresh, _ = _setup(2, seed=5)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    handle = fresh.register_optimizer(fopt)
    assert fresh.register_optimizer(fopt).id == handle.id  # one hook per optimizer
    msd, osd = get_state_dict(fresh, fopt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=f"{root}/adamw")
    set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    after_load = len(fopt.state)
    _train(fresh, fopt, cfg, 2, start=2)
    model.sync_params(); fresh.sync_params()
    owned = sum(1 for p in fresh.parameters() if owner_of(p) is not None and owner_of(p).is_local)
    return {"after_load": after_load, "after_step": len(fopt.state), "owned": owned,
            "trainable": sum(1 for p in fresh.parameters() if p.requires_grad),
            "diff": max((p - q).abs().max().item() for p, q in zip(model.parameters(), fresh.parameters()))}


def test_torch_adamw_standard_dcp_resume_keeps_state_sharded(tmp_path):
    for r in get_pool(2).run(torch_adamw_standard_resume, str(tmp_path)):
        assert r["diff"] == 0.0, r
        assert r["after_load"] == r["trainable"] and r["after_step"] == r["owned"] < r["trainable"], r


def w_stock_fsdp2(root: str) -> dict:
    """replicate <-> stock FSDP2 (torch's fully_shard, Shard(0)) through matrixfsdp.checkpoint,
    torch AdamW on both sides (stock FSDP2 cannot step whole matrices): weights and AdamW state."""
    import matrixfsdp.checkpoint as mckpt
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from _models import Block

    W = dist.get_world_size()
    cfg = TinyConfig(scalar_param=False)  # torch's FSDP2 rejects 0-dim parameters
    mesh = init_device_mesh("cpu", (W,))

    def replicated(seed):
        m = TinyDecoder(cfg, seed=seed)
        matrixfsdp.replicate(m, mesh=mesh, plan=matrixfsdp.plan_owners(
            m, mesh, policy="alpha_balanced", elementwise="owned", bucket_numel=BUCKET))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def stock(seed):
        m = TinyDecoder(cfg, seed=seed)
        for b in m.blocks:
            torch_fully_shard(b, mesh=mesh)
        torch_fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def local_state(m, o):
        """fqn -> {key: this rank's local tensor, its global row offset} (no communication)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        fqn = {id(p): n for n, p in m.named_parameters()}
        out = {}
        for p, st in o.state.items():
            row = {}
            for k, v in st.items():
                if hasattr(v, "to_local"):
                    _, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
                    row[k] = (v.to_local().detach().clone(), off[0] if off else 0)
                else:
                    row[k] = (v.detach().clone(), 0)
            out[fqn[id(p)]] = row
        return out

    def gathered(m, o):
        """Every rank's replicate owner state, merged: fqn -> {key: full tensor}."""
        parts = [None] * W
        dist.all_gather_object(parts, {f: {k: t for k, (t, _) in st.items()} for f, st in local_state(m, o).items()})
        return {f: st for part in parts for f, st in part.items()}

    def matches(ref, m, o):
        ok, n = True, 0
        for f, st in local_state(m, o).items():
            for k, (t, off) in st.items():
                full = ref[f][k]
                ok &= torch.equal(t, full[off:off + t.shape[0]] if t.ndim else full)
                n += 1
        return ok and n > 0

    def params(m):
        if hasattr(m, "sync_params"):
            m.sync_params()
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in m.named_parameters()}

    out = {"to_stock": True, "from_stock": True}
    src, so = replicated(0)
    _train(src, so, cfg, 2)
    mckpt.save(f"{root}/rz", src, so)
    dst, do = stock(9)
    mckpt.load(f"{root}/rz", dst, do)
    ps, pd = params(src), params(dst)
    out["to_stock"] &= all(torch.equal(ps[n], pd[n]) for n in ps)
    out["to_stock"] &= matches(gathered(src, so), dst, do)  # each stock shard = rows of the owner's state
    src, so = stock(1)
    _train(src, so, cfg, 2)
    mckpt.save(f"{root}/sz", src, so)
    dst, do = replicated(8)
    mckpt.load(f"{root}/sz", dst, do)
    ps, pd = params(src), params(dst)
    out["from_stock"] &= all(torch.equal(ps[n], pd[n]) for n in ps)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(src, so, options=StateDictOptions(full_state_dict=True))["state"]
    out["from_stock"] &= matches(full, dst, do)  # each owner's state = the stock run's full state
    return out


def test_checkpoints_to_and_from_stock_fsdp2(tmp_path):
    for r in get_pool(2).run(w_stock_fsdp2, str(tmp_path)):
        assert r["to_stock"] and r["from_stock"], r


def shampoo_soap_parity(name: str) -> dict:
    """Shampoo and SOAP through replicate: the owner's local step on the averaged gradient is the
    DDP step (state only on the owner; its statistics and eigenbases built from the same grads)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref = _setup(2)
    cls = getattr(matrixfsdp.optim, name)
    kw = dict(lr=1e-3, precondition_frequency=2)
    if name == "Shampoo":
        kw["start_preconditioning_step"] = 2
    opt, ref_opt = cls(model, **kw), cls(ref.module, **kw)
    per = BATCH // W
    for step in range(4):
        x, y = make_batch(cfg, step, BATCH)
        sl = slice(rank * per, (rank + 1) * per)
        model.loss(x[sl], y[sl], use_extra=True).backward()
        o = ref(x[sl], use_extra=True)
        torch.nn.functional.cross_entropy(o.reshape(-1, o.shape[-1]), y[sl].reshape(-1)).backward()
        g, bad = _ref_grads_equal(model, ref, 0)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    model.sync_params()
    ref_p = dict(ref.module.named_parameters())
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), TinyDecoder(cfg, seed=0).parameters()))
    return {"grad_diff": g, "bad": bad, "moved": moved,
            "param_diff": max((p - ref_p[n]).abs().max().item() for n, p in model.named_parameters()),
            "state_owned": all(owner_of(p).is_local for p in opt.state)}


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_shampoo_and_soap_match_ddp(name):
    for r in get_pool(2).run(shampoo_soap_parity, name):
        assert not r["bad"] and r["grad_diff"] == 0.0 and r["state_owned"], r
        assert r["param_diff"] == 0.0 and r["moved"] > 1e-4, r


# ==================================================================================== clip devices
def clip_on_rank_without_grads() -> dict:
    """[Note: clip device and group]: under replicate at W=2 with one parameter, rank 1 owns
    nothing and has no gradient; its all-reduce must still use the mesh's device and group."""
    from matrixfsdp.mesh import mesh_device
    import matrixfsdp.placement.clip as clip_mod

    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (W,))
    matrixfsdp.replicate(model, mesh=mesh)
    x = torch.randn(4 * W, 8, generator=torch.Generator().manual_seed(1))
    model(x[4 * rank: 4 * rank + 4]).square().mean().backward()
    seen = []
    orig = clip_mod.dist.all_reduce

    def spy(t, *a, group=None, **k):
        seen.append((str(t.device), group is mesh.get_group()))
        return orig(t, *a, group=group, **k)

    clip_mod.dist.all_reduce = spy
    try:
        norm = matrixfsdp.clip_grad_norm_(model.parameters(), 1e-3)
    finally:
        clip_mod.dist.all_reduce = orig
    for r in range(W):  # the reference: the mean over all ranks' batches
        ref(x[4 * r: 4 * r + 4]).square().mean().div(W).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    return {"has_grad": [p.grad is not None for p in model.parameters()], "seen": seen,
            "mesh_device": str(mesh_device(mesh)), "norm": norm.item(), "ref_norm": ref_norm.item()}


def test_clip_on_a_rank_without_gradients_uses_the_mesh():
    res = get_pool(2).run(clip_on_rank_without_grads)
    assert [r["has_grad"] for r in res] == [[True], [False]], res  # rank 1 owns nothing
    for r in res:
        assert r["seen"] == [(r["mesh_device"], True)], r  # one all-reduce, mesh device and group
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-6), r


def test_clip_device_comes_from_the_mesh_not_the_gradients(monkeypatch):
    """No gradient anywhere on this rank, parameters on the CPU, a (simulated) CUDA mesh: the
    norm's device is the mesh's (the old rule fell back to the CPU)."""
    import types

    import matrixfsdp.placement.clip as clip_mod
    from matrixfsdp.placement.owner import Owned, set_owner

    mesh = types.SimpleNamespace(device_type="cuda", size=lambda: 1)
    monkeypatch.setattr(clip_mod, "mesh_device", lambda m: torch.device(m.device_type, 0))
    p = torch.nn.Parameter(torch.zeros(4, 4))
    set_owner(p, Owned(owner=1, kind="matrix", mesh=mesh, storage="replicated"))
    plain = torch.nn.Parameter(torch.zeros(3))
    device, group = clip_mod.reduction_device_and_group([plain, p])
    assert device == torch.device("cuda", 0) and group is None
    assert clip_mod.reduction_device_and_group([plain])[0] == torch.device("cpu")
