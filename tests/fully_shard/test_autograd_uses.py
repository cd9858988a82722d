"""Runtime v2: FSDP2's execution model under every use of autograd (issue "Runtime v2").

Each scenario runs the sharded ``TinyDecoder`` at W=2 and W=3 next to a single-process reference
that computes the same thing on the whole batch, and compares gradients and parameters directly:

* ``torch.autograd.grad`` w.r.t. activations leaves every ``.grad`` alone, gives the input gradient;
* a gradient penalty (``autograd.grad(create_graph=True)`` then ``backward``) gives the
  single-process gradients; ``backward(create_graph=True)`` raises the same error on every rank;
* post-accumulate-grad hooks on the sharded parameters fire once per parameter with a gradient,
  and an optimizer stepped from them equals the normal loop;
* a block whose parameters are all frozen is resharded as soon as backward leaves it;
* a discarded grad-mode output kept alive by a reference cycle on one rank only (GC skew);
* an exception inside a block's forward, caught by the loop, then more steps;
* ``reshard_after_forward=False`` keeps the root's parameters unsharded: a head used outside
  ``forward`` (chunked loss) works;
* fp16 reductions pre- and post-divide;
* no host sync (``Tensor.item/tolist/cpu``, ``torch.tensor``) from matrixfsdp in forward/backward;
* no ``W``-fold send copy: the largest tensor a rank sends is its own chunk; temporary bytes per
  materialization are counted; no process group is created per owner.
"""

from __future__ import annotations

import copy
import gc
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import LocalMatrixOpt, TinyConfig, TinyDecoder, local_of, make_batch, make_plan, opt_groups
from fully_shard.test_parity import compare_to_ref, shard_model

import matrixfsdp
from matrixfsdp._fully_shard import get_state
from matrixfsdp.engine.reducer import divide_factors

BATCH = 12
TOL = 1e-6
# parameters after a few AdamW/Newton-Schulz steps: fp32 summation order over 3 ranks, amplified
# (a stale-weight bug is off by ~3e-3)
PARAM_TOL = 1e-5


def _setup(W, model_cls=TinyDecoder, **shard_kw):
    cfg = TinyConfig()
    model = model_cls(cfg, seed=0)
    ref = copy.deepcopy(model)
    plan = make_plan(model, W)
    shard_model(model, init_device_mesh("cpu", (W,)), plan, **shard_kw)
    return cfg, model, ref, plan


def _slices(W):
    per = BATCH // W
    return [slice(r * per, (r + 1) * per) for r in range(W)]


def _capture_block0_input(model):
    box = []

    def hook(module, args, kwargs):
        box.append(args[0])

    return box, model.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


# ================================================================================ autograd.grad
def autograd_grad_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    x, y = make_batch(cfg, 0, BATCH)
    mine = _slices(W)[rank]
    box, h = _capture_block0_input(model)
    loss = model.loss(x[mine], y[mine])
    (gx,) = torch.autograd.grad(loss, box[0])
    h.remove()
    rbox, rh = _capture_block0_input(ref)
    (rgx,) = torch.autograd.grad(ref.loss(x[mine], y[mine]), rbox[0])
    rh.remove()
    out = {"input_grad_diff": (gx - rgx).abs().max().item(),
           "grads_none": all(p.grad is None for p in model.parameters())}
    # the same forward's graph can still be used for a normal backward afterwards
    counter = matrixfsdp._fully_shard.comm_counter(model)
    box, h = _capture_block0_input(model)
    loss = model.loss(x[mine], y[mine])
    h.remove()
    counter.reset()
    torch.autograd.grad(loss, box[0], retain_graph=True)
    out["grad_only_loss_calls"] = counter.calls.get("reduce_scatter", 0)
    out["grads_none_again"] = all(p.grad is None for p in model.parameters())
    loss.backward()
    sum(ref.loss(x[s], y[s]) for s in _slices(W)) .div(W).backward()
    out["grad_diff_after"] = compare_to_ref(model, ref, plan, rank, W, "grad")
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_autograd_grad_leaves_grad_alone(W):
    for r in get_pool(W).run(autograd_grad_check):
        assert r["grads_none"] and r["grads_none_again"]
        assert r["input_grad_diff"] == 0.0
        assert r["grad_only_loss_calls"] == 0  # a non-accumulating backward reduces nothing
        assert r["grad_diff_after"] <= TOL


# ================================================================================ double backward
def gradient_penalty_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    opt = LocalMatrixOpt(opt_groups(model, plan))
    ref_opt = LocalMatrixOpt(opt_groups(ref, plan))
    out = {"grad_diff": 0.0, "param_diff": 0.0}

    def penalized(m, xs, ys):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        box, h = _capture_block0_input(m)
        with sdpa_kernel(SDPBackend.MATH):  # the flash CPU kernel has no double backward
            loss = m.loss(xs, ys)
        h.remove()
        (g,) = torch.autograd.grad(loss, box[0], create_graph=True)
        return loss + 0.1 * g.pow(2).sum()

    for step in range(2):
        x, y = make_batch(cfg, step, BATCH)
        penalized(model, x[_slices(W)[rank]], y[_slices(W)[rank]]).backward()
        for s in _slices(W):
            (penalized(ref, x[s], y[s]) / W).backward()
        out["grad_diff"] = max(out["grad_diff"], compare_to_ref(model, ref, plan, rank, W, "grad"))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out["param_diff"] = compare_to_ref(model, ref, plan, rank, W, "param")
    # higher-order gradients into .grad: one clear error, on every rank, before any collective
    x, y = make_batch(cfg, 5, BATCH)
    try:
        model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]]).backward(create_graph=True)
        out["create_graph_error"] = None
    except RuntimeError as e:
        out["create_graph_error"] = str(e)
    # and the model keeps training correctly afterwards
    model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]]).backward()
    sum(ref.loss(x[s], y[s]) for s in _slices(W)).div(W).backward()
    out["grad_diff_recovered"] = compare_to_ref(model, ref, plan, rank, W, "grad")
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_gradient_penalty_matches_single_process(W):
    for r in get_pool(W).run(gradient_penalty_check):
        assert r["grad_diff"] <= TOL and r["param_diff"] <= PARAM_TOL, r
        assert "backward(create_graph=True) is not supported" in r["create_graph_error"]
        assert r["grad_diff_recovered"] <= TOL


# ================================================================================ hooks
def post_accumulate_hook_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig()
    base = TinyDecoder(cfg, seed=0)
    plan = make_plan(base, W)
    mesh = init_device_mesh("cpu", (W,))
    a, b = shard_model(copy.deepcopy(base), mesh, plan), shard_model(copy.deepcopy(base), mesh, plan)
    kw = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)
    opt_a = matrixfsdp.optim.Muon(a.parameters(), **kw)
    per_param = {p: matrixfsdp.optim.Muon([p], **kw) for p in b.parameters() if p.requires_grad}
    fired: dict[str, int] = {}
    names = {p: n for n, p in b.named_parameters()}

    def hook(p):
        fired[names[p]] = fired.get(names[p], 0) + 1
        per_param[p].step()
        per_param[p].zero_grad()

    for p in per_param:
        p.register_post_accumulate_grad_hook(hook)
    mine = _slices(W)[rank]
    out = {}
    for step in range(3):
        x, y = make_batch(cfg, step, BATCH)
        use = step == 1  # the gated projection is used on step 1 only
        a.loss(x[mine], y[mine], use_extra=use).backward()
        fired.clear()
        b.loss(x[mine], y[mine], use_extra=use).backward()
        out[f"fired_{step}"] = dict(fired)
        opt_a.step()
        opt_a.zero_grad()
    out["param_diff"] = max((local_of(p) - local_of(q)).abs().max().item() if local_of(p).numel() else 0.0
                            for p, q in zip(a.parameters(), b.parameters()))
    out["trainable"] = sorted(n for n, p in b.named_parameters() if p.requires_grad)
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_post_accumulate_grad_hooks_and_optimizer_in_backward(W):
    for r in get_pool(W).run(post_accumulate_hook_check):
        gated = "blocks.1.extra.weight"
        for step in range(3):
            fired = r[f"fired_{step}"]
            expected = {n: 1 for n in r["trainable"] if n != gated or step == 1}
            assert fired == expected, (step, fired)
        assert r["param_diff"] == 0.0


# ================================================================================ frozen block
def frozen_block_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    for m in (model, ref):
        for p in m.blocks[1].parameters():
            p.requires_grad_(False)
    seen = []

    def out_hook(module, args, output):
        output.register_hook(lambda g: seen.append(get_state(model.blocks[1]).group.is_resharded))

    model.blocks[0].register_forward_hook(out_hook)
    x, y = make_batch(cfg, 0, BATCH)
    model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]]).backward()
    sum(ref.loss(x[s], y[s]) for s in _slices(W)).div(W).backward()
    return {"resharded_when_left": seen, "grad_diff": compare_to_ref(model, ref, plan, rank, W, "grad"),
            "frozen_grads_none": all(p.grad is None for p in model.blocks[1].parameters())}


@pytest.mark.parametrize("W", [2, 3])
def test_frozen_block_reshards_after_its_backward(W):
    for r in get_pool(W).run(frozen_block_check):
        assert r["resharded_when_left"] == [True]
        assert r["grad_diff"] <= TOL and r["frozen_grads_none"]


# ================================================================================ GC skew, exceptions
def _train_with(disturb, steps=4) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    opt, ref_opt = LocalMatrixOpt(opt_groups(model, plan)), LocalMatrixOpt(opt_groups(ref, plan))
    mine = _slices(W)[rank]
    keep = []
    for step in range(steps):
        x, y = make_batch(cfg, step, BATCH)
        model.loss(x[mine], y[mine]).backward()
        sum(ref.loss(x[s], y[s]) for s in _slices(W)).div(W).backward()
        disturb(step, model, x[mine], y[mine], keep)  # between backward and the optimizer step
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return {"param_diff": compare_to_ref(model, ref, plan, rank, W, "param")}


def _gc_skew(step, model, x, y, keep):
    if step == 0:
        gc.disable()
    if step == 1:  # every rank: a grad-mode output never backwarded, kept alive by a cycle
        junk = model.loss(x, y)
        cycle = [junk]
        cycle.append(cycle)
        del junk, cycle
        if dist.get_rank() == 0:
            gc.collect()  # collected on rank 0 only, before the next iteration
    if step == 3:
        gc.enable()


def _forward_raises(step, model, x, y, keep):
    if step != 2:
        return

    def boom(module, args):
        raise RuntimeError("bad batch")

    h = model.blocks[1].up.register_forward_pre_hook(boom)
    try:
        model.loss(x, y)
    except RuntimeError as e:
        assert "bad batch" in str(e)
        keep.append(e)  # a loop that logs its errors keeps the traceback (and its frames) alive
    h.remove()


def gc_skew_check() -> dict:
    return _train_with(_gc_skew)


def forward_exception_check() -> dict:
    return _train_with(_forward_raises)


@pytest.mark.parametrize("W", [2, 3])
def test_gc_skew_across_ranks_neither_hangs_nor_changes_results(W):
    for r in get_pool(W).run(gc_skew_check, timeout=120):
        assert r["param_diff"] <= PARAM_TOL


@pytest.mark.parametrize("W", [2, 3])
def test_exception_in_forward_then_steps_match_reference(W):
    for r in get_pool(W).run(forward_exception_check):
        assert r["param_diff"] <= PARAM_TOL


# ================================================================================ head outside forward
class HiddenDecoder(TinyDecoder):
    """Returns the final hidden states; the loss applies ``head`` outside ``forward`` in chunks."""

    def forward(self, idx, use_extra=False):
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def loss(self, idx, targets, use_extra=False):
        h = self(idx)
        total = 0.0
        for hs, ts in zip(h.split(2), targets.split(2)):  # chunked loss: head used outside forward
            logits = self.head(hs)
            total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ts.reshape(-1),
                                            reduction="sum")
        return total / targets.numel()


def head_outside_forward_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W, model_cls=HiddenDecoder)
    x, y = make_batch(cfg, 0, BATCH)
    model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]]).backward()
    sum(ref.loss(x[s], y[s]) for s in _slices(W)).div(W).backward()
    return {"grad_diff": compare_to_ref(model, ref, plan, rank, W, "grad"),
            "resharded_after": get_state(model).group.is_resharded}


@pytest.mark.parametrize("W", [2, 3])
def test_root_keeps_unsharded_params_after_forward(W):
    for r in get_pool(W).run(head_outside_forward_check):
        assert r["grad_diff"] <= TOL and r["resharded_after"]


# ================================================================================ fp16 reductions
def test_divide_factors_pre_and_post_divide_narrow_dtypes():
    assert divide_factors(4, None, torch.float32) == (1.0, 4.0)  # exact DDP parity in fp32
    assert divide_factors(256, None, torch.bfloat16) == (1.0, 256.0)
    assert divide_factors(4, None, torch.float16) == (2.0, 2.0)
    assert divide_factors(256, None, torch.float16) == (16.0, 16.0)
    assert divide_factors(3, None, torch.float16) == (1.0, 3.0)
    assert divide_factors(8, 1.0, torch.float16) == (1.0, 1.0)


def fp16_reduce_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (W,))
    # owned (two matrices on up to 4 ranks would be hosted by default): the owners' whole gradients
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(torch.nn.Linear,), placement="owned")
    mp = matrixfsdp.MixedPrecisionPolicy(reduce_dtype=torch.float16)
    for m in model:
        matrixfsdp.fully_shard(m, mesh=mesh, plan=plan, mp_policy=mp)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan, mp_policy=mp)
    x = torch.full((4, 8), 1.0)
    probe = copy.deepcopy(ref)
    probe(x).sum().backward()
    # every rank's gradient peaks at 3e4: their fp16 sum (W * 3e4) overflows unless pre-divided
    scale = 3e4 / max(p.grad.abs().max().item() for p in probe.parameters())
    (model(x).sum() * scale).backward()
    (ref(x).sum() * scale).backward()
    out = {"finite": all(torch.isfinite(local_of(p.grad)).all().item() for p in model.parameters()),
           "max_rel": 0.0}
    for (fqn, p), rp in zip(model.named_parameters(), ref.parameters()):
        g = local_of(p.grad)
        if g.numel():
            out["max_rel"] = max(out["max_rel"], ((g - rp.grad) / rp.grad.abs().max()).abs().max().item())
    out["max_abs_grad"] = max(rp.grad.abs().max().item() for rp in ref.parameters())
    return out


def test_fp16_reduction_does_not_overflow_at_w4():
    for r in get_pool(4).run(fp16_reduce_check):
        assert r["max_abs_grad"] * 4 > 65504  # summing first would overflow
        assert r["finite"] and r["max_rel"] < 2e-3, r


# ================================================================================ host syncs
def host_sync_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    mine = _slices(W)[rank]
    calls: list[str] = []
    names = ("item", "tolist", "cpu", "numpy")
    orig = {n: getattr(torch.Tensor, n) for n in names}
    orig_tensor = torch.tensor

    def from_matrixfsdp() -> bool:
        return any("/matrixfsdp/" in f.filename for f in traceback.extract_stack()[:-2])

    def patched(n):
        def f(self, *a, **k):
            if from_matrixfsdp():
                calls.append(n)
            return orig[n](self, *a, **k)
        return f

    def patched_tensor(*a, **k):
        if from_matrixfsdp():
            calls.append("torch.tensor")
        return orig_tensor(*a, **k)

    from matrixfsdp.engine import reducer as engine_reduce

    out = {}
    grads = {}
    # steps 0, 1: every parameter used; 2: one unused (the default reads the flags); 3: the same
    # batch with set_find_unused_parameters(False): no read at all
    for step, use_extra in enumerate((True, True, False, False)):
        if step == 3:
            model.set_find_unused_parameters(False)
        x, y = make_batch(cfg, min(step, 2), BATCH)
        reads = engine_reduce.host_reads[0]
        for n in names:
            setattr(torch.Tensor, n, patched(n))
        torch.tensor = patched_tensor
        try:
            calls.clear()
            model.loss(x[mine], y[mine], use_extra=use_extra).backward()
        finally:
            for n in names:
                setattr(torch.Tensor, n, orig[n])
            torch.tensor = orig_tensor
        out[f"calls_{step}"] = list(calls)
        out[f"reads_{step}"] = engine_reduce.host_reads[0] - reads
        grads[step] = {n: None if p.grad is None else local_of(p.grad).clone()
                       for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None
    model.set_find_unused_parameters(True)
    # opted out, a parameter no rank used gets zeros instead of None; every other one the same bits
    out["opt_out_same"] = all(
        (torch.equal(grads[3][n], g) if g is not None else not grads[3][n].any())
        for n, g in grads[2].items() if grads[3][n] is not None or g is not None)
    out["unused_none_2"] = sorted(n for n, g in grads[2].items() if g is None)
    out["unused_none_3"] = sorted(n for n, g in grads[3].items() if g is None)
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_no_host_sync_in_forward_and_backward(W):
    for r in get_pool(W).run(host_sync_check):
        assert r["calls_0"] == [] and r["calls_1"] == [], r
        # a step where a parameter went unused reads the summed usage flags once, at the end of
        # backward, for all blocks together ([Note: usage-flag host read])
        assert r["calls_2"] == ["tolist"] and r["reads_2"] == 1, r
        assert r["reads_0"] == r["reads_1"] == 0, r
        # set_find_unused_parameters(False): no read, no host sync, with the parameter unused
        assert r["calls_3"] == [] and r["reads_3"] == 0, r
        assert r["unused_none_2"] and r["opt_out_same"], r


# ================================================================================ buffers, groups
def buffers_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    groups_before = len(dist.distributed_c10d._world.pg_map)
    cfg, model, ref, plan = _setup(W)
    groups_created = len(dist.distributed_c10d._world.pg_map) - groups_before
    sent: list[int] = []
    orig_batch, orig_a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return orig_batch(ops)

    def a2a(out, inp, *a, **k):
        sent.append(inp.numel())
        return orig_a2a(out, inp, *a, **k)

    dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a
    try:
        x, y = make_batch(cfg, 0, BATCH)
        model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]]).backward()
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = orig_batch, orig_a2a
    states = [get_state(model), *(get_state(b) for b in model.blocks)]
    # gathers send this rank's chunk; gloo's reduce-scatter sends each destination its own chunk
    # (``_p2p_reduce_scatter``): nothing sent is larger than the largest rank's chunk plus its
    # usage flags (one per parameter) and the padding to 16 bytes (< 4 fp32 elements)
    chunk_max = max(max(s.group.layout.chunk_numel) + len(s.params) + 3 for s in states)
    es = 4
    return {
        "max_sent": max(sent), "chunk_max": chunk_max, "groups_created": groups_created,
        # receive + cast + assembly + compact buffers + at most one send copy of this rank's chunk
        "temp_ok": [s.group.temp_bytes_peak <= (sum(t.numel() for t in s.group._buffers)
                                                + s.group.layout.chunk_numel[rank]) * es
                    for s in states],
        "temp_peaks": [s.group.temp_bytes_peak for s in states],
    }


def test_no_w_fold_send_copy_and_counted_temporaries():
    for r in get_pool(3).run(buffers_check):
        assert r["max_sent"] <= r["chunk_max"], r  # the chunk itself, never W-1 copies of it
        assert all(r["temp_ok"]) and all(t > 0 for t in r["temp_peaks"]), r
        assert r["groups_created"] == 0, r  # owner meshes need no communicator


# ================================================================================ reentrant AC
class ReentrantCheckpointDecoder(TinyDecoder):
    """Every block under torch's *reentrant* activation checkpointing (its forward runs under
    no_grad; backward recomputes it in a nested backward)."""

    def forward(self, idx, use_extra=False):
        import functools

        from torch.utils.checkpoint import checkpoint

        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for i, blk in enumerate(self.blocks):
            fn = functools.partial(blk, use_extra=use_extra) if i == self.cfg.gated_block else blk
            x = checkpoint(fn, x, use_reentrant=True)
        return self.head(self.norm(x))


def reentrant_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W, model_cls=ReentrantCheckpointDecoder)
    out = {"grad_diff": 0.0}
    for step in range(2):
        x, y = make_batch(cfg, step, BATCH)
        model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]], use_extra=step == 1).backward()
        sum(ref.loss(x[s], y[s], use_extra=step == 1) for s in _slices(W)).div(W).backward()
        out["grad_diff"] = max(out["grad_diff"], compare_to_ref(model, ref, plan, rank, W, "grad"))
        for m in (model, ref):
            m.zero_grad()
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_reentrant_activation_checkpointing(W):
    for r in get_pool(W).run(reentrant_check):
        assert r["grad_diff"] <= TOL, r


# ================================================================================ outside-user findings
def inplace_and_retype_check() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    x, y = make_batch(cfg, 0, BATCH)
    out = {}
    # an in-place op on a sharded module's output (temperature scaling), as plain torch allows
    logits = model(x[_slices(W)[rank]])
    logits /= 2.0
    F.cross_entropy(logits.reshape(-1, cfg.vocab), y[_slices(W)[rank]].reshape(-1)).backward()
    rl = sum(F.cross_entropy((ref(x[s]) / 2.0).reshape(-1, cfg.vocab), y[s].reshape(-1)) for s in _slices(W)) / W
    rl.backward()
    out["inplace_grad_diff"] = compare_to_ref(model, ref, plan, rank, W, "grad")
    # model.to(dtype) after sharding: buffers and unsharded leaves follow the new dtype
    model.zero_grad(), ref.zero_grad()
    model.to(torch.float64), ref.to(torch.float64)
    with torch.no_grad():
        out["float64_loss_diff"] = (model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]])
                                    - ref.loss(x[_slices(W)[rank]], y[_slices(W)[rank]])).abs().item()
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_inplace_on_outputs_and_model_to_dtype(W):
    for r in get_pool(W).run(inplace_and_retype_check):
        assert r["inplace_grad_diff"] <= TOL and r["float64_loss_diff"] <= 1e-12, r
        assert r["dtypes"] == ["torch.float64"]


# ================================================================================ reduce streams
def reduce_copy_in_stream_check() -> dict:
    """[Note: streams] in engine/reducer.py: the reduction's copy-in (``torch.cat`` of autograd's gradients) is
    issued outside ``CommContext.use`` (on the compute stream), and the reduce-scatter inside it.
    On the CPU both contexts are no-ops, so the order is checked on the calls themselves."""
    import sys

    from matrixfsdp._fully_shard import param_group

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    depth = [0]
    seen: list[tuple[str, int]] = []
    orig_use, orig_cat = param_group.CommContext.use, torch.cat

    def use(self, stream):
        cm = orig_use(self, stream)

        class Tracked:
            def __enter__(self_):
                depth[0] += 1
                return cm.__enter__()

            def __exit__(self_, *exc):
                depth[0] -= 1
                return cm.__exit__(*exc)
        return Tracked()

    def cat(*a, **k):
        if sys._getframe(1).f_code.co_name == "copy_in":
            seen.append(("copy-in", depth[0]))
        return orig_cat(*a, **k)

    orig_rs = {}
    for s in [get_state(model), *(get_state(b) for b in model.blocks)]:
        coll = s.group.coll
        if id(coll) not in orig_rs:
            orig_rs[id(coll)] = (coll, coll.reduce_scatter_segments)

            def rs(*a, _f=coll.reduce_scatter_segments, **k):
                seen.append(("reduce-scatter", depth[0]))
                return _f(*a, **k)
            coll.reduce_scatter_segments = rs
    param_group.CommContext.use, torch.cat = use, cat
    try:
        x, y = make_batch(cfg, 0, BATCH)
        model.loss(x[_slices(W)[rank]], y[_slices(W)[rank]], use_extra=True).backward()
    finally:
        param_group.CommContext.use, torch.cat = orig_use, orig_cat
        for coll, f in orig_rs.values():
            coll.reduce_scatter_segments = f
    return {"seen": seen, "n_blocks": 1 + len(model.blocks)}


def test_reduce_copy_in_runs_outside_the_reduce_stream():
    for r in get_pool(2).run(reduce_copy_in_stream_check):
        n = r["n_blocks"]
        assert r["seen"] == [("copy-in", 0), ("reduce-scatter", 1)] * n, r
