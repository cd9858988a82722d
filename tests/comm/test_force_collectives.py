"""``force_collectives()``, the W=1 test hook of ``comm/collectives.py`` (issue 29): inside it a
one-rank group calls its backend (counted by the process group's sequence number) and every result
is the short-cut's bit for bit; outside it nothing reaches the process group. One process, gloo."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from matrixfsdp.comm.collectives import KINDS, _FORCED, collectives_for, force_collectives


@pytest.fixture
def group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def _seq(group) -> int:
    """Collectives this process group has issued so far."""
    return group._get_sequence_number_for_group()


def _every_call(coll) -> dict[str, torch.Tensor]:
    """Each W=1 entry point once, on fresh inputs; their outputs (and in-place buffers)."""
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(37, generator=g)
    out = {"rs": torch.full((37,), float("nan"))}
    coll.reduce_scatter_segments(out["rs"], inp, [37], async_op=True).wait()
    send, recv = torch.randn(11, generator=g), torch.empty(0)
    coll.all_gather_segments(send, recv, [0], async_op=True).wait()
    out["ag_send"], out["ag_recv"] = send, recv
    out["inplace"] = torch.randn(13, generator=g)
    coll.all_gather_inplace(out["inplace"], [13], async_op=True).wait()
    out["ar"] = torch.randn(7, generator=g)
    coll.all_reduce(out["ar"], async_op=True).wait()
    out["a2a"] = torch.full((5,), float("nan"))
    coll.all_to_all_single(out["a2a"], torch.arange(5.0), [5], [5], async_op=True).wait()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_forced_calls_reach_the_group_with_the_short_cuts_results(group, kind):
    coll = collectives_for(group, kind)
    s0 = _seq(group)
    plain = _every_call(coll)
    s1 = _seq(group)
    with force_collectives():
        forced = _every_call(coll)
    s2 = _seq(group)
    assert s1 == s0, "without the hook W=1 issues nothing"
    # reduce-scatter, gather, in-place gather, all-reduce, all-to-all: at least one call each
    # (the two-phase forms issue two)
    assert s2 - s1 >= 5, (kind, s2 - s1)
    assert _FORCED[0] == 0
    for k in plain:
        assert torch.equal(plain[k], forced[k]), (kind, k)


def _train(group, kind: str, force: bool) -> tuple[dict, dict, int]:
    """Three steps of the tiny decoder under ``fully_shard`` at W=1 with bf16 compute (so each
    block's gather runs: its owner computes on a cast copy) and Muon; the final parameters, the
    last gradients and the process group's calls during training."""
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp
    from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer

    torch.manual_seed(0)
    model = Decoder(PRESETS["tiny"])
    mesh = init_device_mesh("cpu", (1,))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
    mp = matrixfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan, mp_policy=mp, collectives=kind)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan, mp_policy=mp, collectives=kind)
    opt = matrixfsdp.optim.Muon(model, lr=0.02)
    s0 = _seq(group)
    with force_collectives() if force else contextlib.nullcontext():
        for step in range(3):
            tokens = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(step))
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512).float(), tokens.roll(-1, 1).reshape(-1))
            loss.backward()
            grads = {n: p.grad._local_tensor.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
    calls = _seq(group) - s0
    return {n: p._local_tensor.detach().clone() for n, p in model.named_parameters()}, grads, calls


def test_training_at_w1_is_bitwise_the_same_with_the_hook(group):
    params, grads, calls = _train(group, "all_to_all", force=False)
    fparams, fgrads, fcalls = _train(group, "all_to_all", force=True)
    assert calls == 0, calls
    # per step and block (4 layers + root): one gather and one reduction at least
    assert fcalls >= 3 * 5 * 2, fcalls
    for n in params:
        assert torch.equal(grads[n], fgrads[n]), n
        assert torch.equal(params[n], fparams[n]), n
