"""Checkpoints of expert stacks (issue 26): DCP save at one expert assignment, load at another.

One W=2 run per MoE variant (``MoEConfig(experts=5)`` with w1/w2/w3 stacks, and ``fused=True``
with Hugging Face's ``gate_up_proj`` of two matrices per expert) trains 2 steps with
``Muon(model, ns_dtype=torch.float32)``, saves by the standard DCP path (``get_state_dict`` +
``dcp.save``) and by ``matrixfsdp.checkpoint.save``, records the full parameters and the full
optimizer state (``StateDictOptions(full_state_dict=True)``: every rank gets the whole ``[E, ...]``
stacks and ``[E * splits, ...]`` states), then trains one more step. The tests load both
checkpoints at W=3 (the planner's other expert counts) and into one process (a plain model):
parameters and every rank's per-expert optimizer rows bitwise, one more step within 1e-6 of the
uninterrupted run. Also: stock FSDP2 (``Shard(0)``, torch.chunk rows) to and from matrixfsdp
(weights, bitwise), ``full_tensor``/``set_full_`` at W=3, a checkpoint or state dict of another
expert count refused naming the shapes, and the safetensors export and ``save_pretrained`` of
expert stacks equal to the plain model's tensors. Numbers are printed (run with ``-s``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from _harness import get_pool
from _moe import MoEConfig, MoEModel, moe_batch

import matrixfsdp
import matrixfsdp.checkpoint as mckpt
from matrixfsdp.optim import Muon

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BATCH = 12  # divisible by 1, 2 and 3
SAVE_AT = 2
TOL = 1e-6
KINDS = {"flat": dict(experts=5), "fused": dict(experts=5, fused=True)}
FULL = StateDictOptions(full_state_dict=True)


# ==================================================================================== helpers
def build(kind, W=None, experts=None):
    """The MoE model (+ ``Muon(model)``), sharded by matrixfsdp at world ``W`` (plain if None);
    returns the expert counts per stack fqn the plan gave (``{}`` for a plain model)."""
    from matrixfsdp import fully_shard, plan_owners

    cfg = MoEConfig(**{**KINDS[kind], **({"experts": experts} if experts else {})})
    model = MoEModel(cfg)
    counts = {}
    if W is not None:
        mesh = init_device_mesh("cpu", (W,))
        plan = plan_owners(model, mesh, block_types=type(model.blocks[0]))
        for b in model.blocks:
            fully_shard(b, mesh=mesh, plan=plan)
        fully_shard(model, mesh=mesh, plan=plan)
        counts = {pp.fqn: (tuple(pp.experts), pp.splits) for pp in plan.params if pp.placement == "experts"}
    return model, Muon(model, ns_dtype=torch.float32), counts


def train(model, opt, steps):
    rank = dist.get_rank() if dist.is_initialized() else 0
    W = dist.get_world_size() if dist.is_initialized() else 1
    per = BATCH // W
    for step in steps:
        x, y = moe_batch(model.cfg, step, BATCH)
        model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def full_params(model):
    return {f: matrixfsdp.full_tensor(p).detach().clone() for f, p in model.named_parameters()}


def std_save(model, opt, path):
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def std_load(model, opt, path):
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def state_by_fqn(model, opt):
    """This rank's optimizer state (local tensors) by parameter fqn."""
    fqn_of = {id(p): f for f, p in model.named_parameters()}
    return {fqn_of[id(p)]: {k: local(v) for k, v in st.items()} for p, st in opt.state.items() if st}


def full_state(model, opt):
    """The full optimizer state on every rank (torch's full state dict: expert stacks gathered)."""
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    return {f: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for f, st in osd["state"].items()}


def same_state(a, b):
    """Bitwise equal state dicts (same fqns, keys, values); returns the differing entries."""
    bad = sorted(set(a) ^ set(b))
    for f in set(a) & set(b):
        if set(a[f]) != set(b[f]):
            bad.append(f)
        bad += [f"{f}.{k}" for k in set(a[f]) & set(b[f]) if not torch.equal(a[f][k], b[f][k])]
    return bad


def check_expert_rows(model, opt, counts, ref_state):
    """Every rank holds exactly the saved state rows of its own experts (per expert, bitwise):
    rank r's rows of a stack's state are experts [first, first + n) of the saved run's state,
    ``splits`` rows each; a rank holding none keeps none. Returns (rows checked, mismatches)."""
    _, s = (0, dist.get_rank()) if dist.is_initialized() else (0, 0)
    mine = state_by_fqn(model, opt)
    checked, bad = 0, []
    for fqn, (cnt, _) in counts.items():
        first, n = sum(cnt[:s]), cnt[s]
        if n == 0:
            if mine.get(fqn):
                bad.append(f"{fqn}: state on a rank without experts")
            continue
        for k, ref in ref_state[fqn].items():
            if ref.ndim == 0:
                continue
            f = ref.shape[0] // sum(cnt)
            got = mine[fqn][k]
            if not torch.equal(got, ref[first * f:(first + n) * f]):
                bad.append(f"{fqn}.{k}")
            checked += got.shape[0]
    return checked, bad


# ==================================================================================== workers
def w_save(root, kind):
    """W=2: train 2 steps, save both ways, record the full params/state, train one more step."""
    rank = dist.get_rank()
    d = os.path.join(root, kind)
    model, opt, counts = build(kind, dist.get_world_size())
    train(model, opt, range(SAVE_AT))
    std_save(model, opt, os.path.join(d, "std"))
    mckpt.save(os.path.join(d, "helper"), model, opt)
    params = full_params(model)
    state = full_state(model, opt)
    # torch's full state dicts on every rank: the whole stacks and their whole per-matrix state
    msd = get_model_state_dict(model, options=FULL)
    out = {"counts": counts, "full_model_ok": all(
        not isinstance(msd[f], DTensor) and torch.equal(msd[f], params[f]) for f in params)}
    out["full_shapes"] = {f: (tuple(msd[f].shape), {k: tuple(v.shape) for k, v in state[f].items()})
                          for f in counts}
    out["experts_rows_ok"] = check_expert_rows(model, opt, counts, state)
    if rank == 0:
        torch.save({"params": params, "state": state, "counts": counts}, os.path.join(d, "ref.pt"))
    train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    final = full_params(model)
    if rank == 0:
        torch.save(final, os.path.join(d, "ref_final.pt"))
    return out


def w_reshard(root, kind):
    """Load the W=2 checkpoints at this world (other expert counts), both paths; parameters and
    per-expert state bitwise, one more step against the uninterrupted run."""
    d = os.path.join(root, kind)
    ref = torch.load(os.path.join(d, "ref.pt"))
    ref_final = torch.load(os.path.join(d, "ref_final.pt"))
    out = {}
    for how in ("std", "helper"):
        model, opt, counts = build(kind, dist.get_world_size())
        out["counts"] = counts
        if how == "std":
            std_load(model, opt, os.path.join(d, how))
        else:
            mckpt.load(os.path.join(d, how), model, opt)
        params = full_params(model)
        out[f"{how}_params"] = sorted(f for f in ref["params"] if not torch.equal(params[f], ref["params"][f]))
        out[f"{how}_rows"] = check_expert_rows(model, opt, counts, ref["state"])
        out[f"{how}_state"] = same_state(full_state(model, opt), ref["state"])
        train(model, opt, range(SAVE_AT, SAVE_AT + 1))
        params = full_params(model)
        out[f"{how}_diff"] = max((params[f] - ref_final[f]).abs().max().item() for f in ref_final)
    return out


def w_stacks_roundtrip(kind):
    """full_tensor() and set_full_ of every expert stack at this world (W=3: counts such as
    (3, 2, 0), a rank may hold none): set_full_ writes this rank's experts' rows, full_tensor
    gathers exactly what was set."""
    model, _, counts = build(kind, dist.get_world_size())
    plain = MoEModel(MoEConfig(**KINDS[kind]))
    s = dist.get_rank()
    ok = {}
    for fqn, (cnt, _) in counts.items():
        p = model.get_parameter(fqn)
        before = p.full_tensor()
        new = torch.randn(tuple(p.shape), generator=torch.Generator().manual_seed(len(fqn)))
        matrixfsdp.set_full_(p, new)
        first = sum(cnt[:s])
        ok[fqn] = (torch.equal(before, plain.get_parameter(fqn).detach())
                   and torch.equal(local(p), new[first:first + cnt[s]]) and torch.equal(p.full_tensor(), new)
                   and torch.equal(matrixfsdp.full_tensor(p), new))
    return ok


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for b in model.blocks:
        torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model


def w_fsdp2(root, kind):
    """matrixfsdp checkpoint (W=2) -> stock FSDP2 (W=3, torch.chunk rows of every stack), and a
    stock FSDP2 checkpoint (torch AdamW, 2 steps) -> matrixfsdp (W=3): weights bitwise."""
    W = dist.get_world_size()
    d = os.path.join(root, kind)
    ref = torch.load(os.path.join(d, "ref.pt"))
    mesh = init_device_mesh("cpu", (W,))
    model = _fsdp2(MoEModel(MoEConfig(**KINDS[kind])), mesh)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=os.path.join(d, "std"))
    set_model_state_dict(model, msd)
    out = {"to_fsdp2": sorted(f for f, p in model.named_parameters()
                              if not torch.equal(p.full_tensor(), ref["params"][f]))}
    stack = next(iter(ref["counts"]))
    out["fsdp2_rows"] = local(model.get_parameter(stack)).shape[0]  # torch.chunk's, not the plan's

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, range(SAVE_AT))
    fsdp2_full = {f: p.full_tensor().clone() for f, p in model.named_parameters()}
    dst = os.path.join(d, "fsdp2")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dst)
    for how in ("std", "helper"):
        m2, _, _ = build(kind, W)
        if how == "std":
            msd = get_model_state_dict(m2)
            dcp.load({"model": msd}, checkpoint_id=dst)
            set_model_state_dict(m2, msd)
        else:
            mckpt.load(dst, m2)
        full = full_params(m2)
        out[f"from_fsdp2_{how}"] = sorted(f for f in fsdp2_full if not torch.equal(full[f], fsdp2_full[f]))
    out["changed"] = any(not torch.equal(fsdp2_full[f], ref["params"][f]) for f in fsdp2_full)
    return out


def w_other_expert_count(root, kind):
    """A checkpoint or optimizer state dict of a 4-expert model into the 5-expert one: refused on
    every rank, naming the shapes."""
    W = dist.get_world_size()
    small, small_opt, _ = build(kind, W, experts=4)
    train(small, small_opt, range(1))
    path = os.path.join(root, kind, "e4")
    mckpt.save(path, small, small_opt)
    model, opt, _ = build(kind, W)
    train(model, opt, range(1))
    out = {}
    try:
        mckpt.load(path, model, opt)
        out["helper"] = "no error"
    except ValueError as e:
        out["helper"] = str(e)
    try:
        opt.load_state_dict(small_opt.state_dict())
        out["load_state_dict"] = "no error"
    except ValueError as e:
        out["load_state_dict"] = str(e)
    # this rank's state as a plain tensor of another splits (per-matrix rows of the fused
    # gate_up_proj as one matrix per expert, a flat w1 as two): the layout is checked, not just
    # the element count
    fqn = "blocks.0.mlp.experts." + ("gate_up_proj" if kind == "fused" else "w1")
    p = model.get_parameter(fqn)
    index = [id(q) for g in opt.param_groups for q in g["params"]].index(id(p))
    sd = opt.state_dict()
    mom = local(sd["state"][index]["momentum_buffer"])
    n, rows, cols = local(p).shape
    assert n > 0, (fqn, n)  # the plan gives both ranks experts of this stack
    other = 1 if kind == "fused" else 2
    bad = {**sd, "state": {**sd["state"], index: {"momentum_buffer": mom.reshape(n * other, rows // other, cols)}}}
    out["local_shapes"] = (tuple(mom.shape), (n * other, rows // other, cols))
    try:
        opt.load_state_dict(bad)
        out["local"] = "no error"
    except ValueError as e:
        out["local"] = str(e)
    return out


def w_save_hsdp(root):
    """A (2, 2) HSDP mesh (every replica holds the same experts; replica 0 writes them): save
    after 2 steps, both paths; record the full parameters."""
    from matrixfsdp import fully_shard, plan_owners

    model = MoEModel(MoEConfig(**KINDS["fused"]))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    plan = plan_owners(model, mesh, block_types=type(model.blocks[0]))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)
    opt = Muon(model, ns_dtype=torch.float32)
    train(model, opt, range(SAVE_AT))
    std_save(model, opt, os.path.join(root, "std"))
    mckpt.save(os.path.join(root, "helper"), model, opt)
    params = full_params(model)
    if dist.get_rank() == 0:
        torch.save(params, os.path.join(root, "params.pt"))
    return {pp.fqn: tuple(pp.experts) for pp in plan.params if pp.placement == "experts"}


def w_load_hsdp(root, ref):
    """The HSDP checkpoint at W=3, both paths: parameters and full optimizer state as ``ref``."""
    out = {}
    for how in ("std", "helper"):
        model, opt, _ = build("fused", dist.get_world_size())
        if how == "std":
            std_load(model, opt, os.path.join(root, how))
        else:
            mckpt.load(os.path.join(root, how), model, opt)
        params = full_params(model)
        out[how] = (sorted(f for f in ref["params"] if not torch.equal(params[f], ref["params"][f])),
                    same_state(full_state(model, opt), ref["state"]))
    return out


# ==================================================================================== fixtures
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_experts"))
    return root, {kind: get_pool(2).run(w_save, root, kind, timeout=300) for kind in KINDS}


# ==================================================================================== tests
@pytest.mark.parametrize("kind", list(KINDS))
def test_full_state_dicts_hold_whole_stacks(saved, kind):
    """W=2: torch's full model and optimizer state dicts hold the whole [E, ...] stacks and
    [E * splits, ...] states on every rank; each rank's live state is its experts' rows."""
    _, info = saved
    E = KINDS[kind]["experts"]
    for r in info[kind]:
        assert r["full_model_ok"]
        checked, bad = r["experts_rows_ok"]
        assert checked > 0 and bad == [], bad
        for fqn, (shape, states) in r["full_shapes"].items():
            splits = r["counts"][fqn][1]
            assert shape[0] == E and states == {"momentum_buffer": (E * splits, shape[1] // splits, shape[2])}
    assert {c[1] for c in info[kind][0]["counts"].values()} == ({1, 2} if kind == "fused" else {1})


@pytest.mark.parametrize("kind", list(KINDS))
def test_reshard_to_three_ranks(saved, kind):
    """W=2 -> W=3 (other expert counts), standard DCP path and the helpers: parameters, full
    optimizer state and every rank's per-expert rows bitwise; one more step within 1e-6."""
    root, info = saved
    res = get_pool(3).run(w_reshard, root, kind, timeout=300)
    before = info[kind][0]["counts"]
    after = res[0]["counts"]
    print(f"\n[experts {kind} 2->3] counts {before} -> {after}; "
          f"diff std {max(r['std_diff'] for r in res):.3g} helper {max(r['helper_diff'] for r in res):.3g}")
    assert before.keys() == after.keys() and all(len(after[f][0]) == 3 and after[f][0] != before[f][0]
                                                 for f in before)
    for r in res:
        for how in ("std", "helper"):
            assert r[f"{how}_params"] == [] and r[f"{how}_state"] == [], r
            checked, bad = r[f"{how}_rows"]
            assert bad == [], bad
            assert r[f"{how}_diff"] <= TOL, r
    for how in ("std", "helper"):  # every saved row of every stack's momentum, on exactly one rank
        assert sum(r[f"{how}_rows"][0] for r in res) == sum(sum(c) * s for c, s in before.values())


@pytest.mark.parametrize("kind", list(KINDS))
def test_reshard_to_one_process(saved, kind):
    """W=2 -> one process, plain model + Muon(model): parameters and state bitwise (both paths),
    one more step within 1e-6 of the uninterrupted W=2 run."""
    root, _ = saved
    d = os.path.join(root, kind)
    ref = torch.load(os.path.join(d, "ref.pt"))
    ref_final = torch.load(os.path.join(d, "ref_final.pt"))
    for how in ("std", "helper"):
        model, opt, _ = build(kind)
        if how == "std":
            std_load(model, opt, os.path.join(d, how))
        else:
            mckpt.load(os.path.join(d, how), model, opt)
        assert all(torch.equal(p.detach(), ref["params"][f]) for f, p in model.named_parameters())
        assert same_state(state_by_fqn(model, opt), ref["state"]) == []
        train(model, opt, range(SAVE_AT, SAVE_AT + 1))
        diff = max((p.detach() - ref_final[f]).abs().max().item() for f, p in model.named_parameters())
        print(f"\n[experts {kind} 2->1 {how}] max diff after 1 step: {diff:.3g}")
        assert diff <= TOL


@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp2_interop(saved, kind):
    """Stock FSDP2 (torch.chunk rows: 2, 2, 1 experts at W=3) reads the matrixfsdp checkpoint and
    matrixfsdp reads stock FSDP2's, weights bitwise both ways."""
    root, _ = saved
    res = get_pool(3).run(w_fsdp2, root, kind, timeout=300)
    for r in res:
        assert r["to_fsdp2"] == [] and r["from_fsdp2_std"] == [] and r["from_fsdp2_helper"] == [], r
        assert r["changed"]
    assert [r["fsdp2_rows"] for r in res] == [2, 2, 1]


@pytest.mark.parametrize("kind", list(KINDS))
def test_full_tensor_and_set_full_at_three_ranks(kind):
    res = get_pool(3).run(w_stacks_roundtrip, kind, timeout=300)
    for r in res:
        assert r and all(r.values()), r


@pytest.mark.parametrize("kind", list(KINDS))
def test_other_expert_count_is_refused(tmp_path, kind):
    os.makedirs(tmp_path / kind)
    res = get_pool(2).run(w_other_expert_count, str(tmp_path), kind, timeout=300)
    print(f"\n[experts {kind} E=4 -> E=5] {res[0]}")
    # every rank raises rank 0's error
    assert res[1]["helper"] == res[0]["helper"] + " (reported by rank 0)", res
    for r in res:
        assert r["helper"].startswith("matrixfsdp.checkpoint.load: shape mismatch for 'model.blocks.0."), r
        assert "the model/optimizer expects (5, " in r["helper"] and "has (4, " in r["helper"], r
        for key in ("load_state_dict", "local"):
            assert r[key].startswith("Muon.load_state_dict: state 'momentum_buffer' of expert stack "), r[key]
            assert "torch.distributed.checkpoint" in r[key] and "another number of experts" in r[key], r[key]
        assert "is a DTensor of global shape (4, " in r["load_state_dict"], r["load_state_dict"]
        assert "but this optimizer keeps it as (5, " in r["load_state_dict"], r["load_state_dict"]
        have, other = r["local_shapes"]
        assert f"has shape {other}, but this optimizer keeps it as {have} on this rank" in r["local"], r["local"]


def test_hsdp_checkpoint_reshards(tmp_path):
    """(2, 2) HSDP -> one process and -> W=3 (flat, other counts): bitwise parameters and state."""
    root = str(tmp_path)
    counts = get_pool(4).run(w_save_hsdp, root, timeout=300)[0]
    saved = torch.load(os.path.join(root, "params.pt"))
    ref = {}
    for how in ("std", "helper"):
        model, opt, _ = build("fused")
        (std_load if how == "std" else lambda m, o, p: mckpt.load(p, m, o))(model, opt, os.path.join(root, how))
        assert all(torch.equal(p.detach(), saved[f]) for f, p in model.named_parameters())
        got = {"params": saved, "state": state_by_fqn(model, opt)}
        assert not ref or same_state(got["state"], ref["state"]) == []
        ref = got
    assert all(len(c) == 2 for c in counts.values())
    res = get_pool(3).run(w_load_hsdp, root, ref, timeout=300)
    for r in res:
        assert r == {"std": ([], []), "helper": ([], [])}, r


def test_export_safetensors_equals_plain_model(saved, tmp_path):
    """The W=2 checkpoint (expert stacks written as each rank's rows at its experts' offsets)
    exports to safetensors equal to the plain model's tensors at the save point."""
    from safetensors.torch import load_file

    root, _ = saved
    for kind in KINDS:
        d = os.path.join(root, kind)
        ref = torch.load(os.path.join(d, "ref.pt"))
        out = tmp_path / kind / "model.safetensors"
        mckpt.export_safetensors(os.path.join(d, "helper"), out, keep_tied=True)
        got = load_file(str(out))
        model, _, _ = build(kind)
        mckpt.load(os.path.join(d, "std"), model)
        plain = {k: v.detach() for k, v in model.state_dict().items()}
        assert got.keys() == plain.keys() == ref["params"].keys()
        assert all(torch.equal(got[k], plain[k]) and torch.equal(got[k], ref["params"][k]) for k in plain)
        md = mckpt.read_metadata(os.path.join(d, "helper"))
        for fqn, (cnt, _) in ref["counts"].items():  # one chunk per rank, at its first expert
            chunks = sorted((c.offsets[0], c.sizes[0]) for c in md.state_dict_metadata[f"model.{fqn}"].chunks)
            assert chunks == [(sum(cnt[:r]), n) for r, n in enumerate(cnt) if n], (fqn, chunks, cnt)


# ==================================================================================== save_pretrained
def w_hf_save_pretrained(path):
    """Qwen3-MoE (stacked experts) sharded at this world: save_pretrained writes the plain model's
    tensors."""
    from matrixfsdp import fully_shard, plan_owners
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2))
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = plan_owners(model, mesh, blocks=list(model.model.layers))
    for b in model.model.layers:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)
    stacks = [pp.fqn for pp in plan.params if pp.placement == "experts"]
    mckpt.save_pretrained(model, os.path.join(path, "sharded"))
    if dist.get_rank() == 0:
        ref.save_pretrained(os.path.join(path, "plain"))
    dist.barrier()
    return stacks


def test_hf_save_pretrained_expert_stacks(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    stacks = get_pool(3).run(w_hf_save_pretrained, str(tmp_path), timeout=300)[0]
    assert len(stacks) >= 4, stacks
    got = load_file(str(tmp_path / "sharded" / "model.safetensors"))
    want = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ==================================================================================== full state dicts in
def w_full_state_load(kind: str) -> dict:
    """torch's full-state-dict loaders into expert stacks ([Note: torch's full state-dict loaders
    and expert stacks] in placement/experts.py): a plain model's trained weights and optimizer state,
    loaded by set_model_state_dict / set_optimizer_state_dict with full_state_dict=True and rank 0's
    dict broadcast (other ranks pass {}), equal the plain run's bitwise, then one more step alike
    (without broadcast_from_rank0 torch's loader refuses owned tensors, as documented)."""
    W = dist.get_world_size()

    def train_plain(model, opt, steps):  # the whole batch on every rank: the sharded run's mean loss
        per = BATCH // W
        for step in steps:
            x, y = moe_batch(model.cfg, step, BATCH)
            (sum(model.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(W)) / W).backward()
            opt.step()
            opt.zero_grad()

    ref, ref_opt, _ = build(kind)
    train_plain(ref, ref_opt, range(SAVE_AT))
    out = {}
    for bcast in (True,):
        model, opt, counts = build(kind, W)
        train(model, opt, [0])  # state exists (loading replaces it)
        msd = ref.state_dict() if (dist.get_rank() == 0 or not bcast) else {}
        osd = get_optimizer_state_dict(ref, ref_opt, options=FULL) if (dist.get_rank() == 0 or not bcast) else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast)
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
        params = full_params(model)
        diff_p = [f for f, t in full_params(ref).items() if not torch.equal(t, params[f])]
        diff_s = same_state(full_state(ref, ref_opt), full_state(model, opt))
        r2, o2 = copy.deepcopy(ref), None
        o2 = Muon(r2, ns_dtype=torch.float32)
        o2.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        train_plain(r2, o2, [SAVE_AT])
        train(model, opt, [SAVE_AT])
        diffs = {f: (full_params(r2)[f] - t).abs().max().item() for f, t in full_params(model).items()}
        step = max(diffs.values())
        if step > TOL:
            print(sorted(diffs.items(), key=lambda kv: -kv[1])[:5])
        out[bcast] = (diff_p, diff_s, step, counts)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_full_state_dict_loads_into_expert_stacks(kind):
    for r in get_pool(3).run(w_full_state_load, kind, timeout=300):
        for bcast, (diff_p, diff_s, step, counts) in r.items():
            assert not diff_p and not diff_s, (bcast, diff_p, diff_s)
            assert step <= TOL, (bcast, step)
            assert any(len({c for c in cnt}) > 1 for cnt, _ in counts.values())  # not torch.chunk's rows
