"""The multi-process harness itself, and the segment collectives on gloo (W = 2, 3, 4)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _harness import DistPool, DistributedTestError, DistributedTestTimeout, get_pool

from matrixfsdp.comm.collectives import (
    AllToAllCollectives,
    P2PCollectives,
    SegmentCollectives,
    TwoPhaseCollectives,
    collectives_for,
)


# ==================================================================================== harness
def _rank_and_size(x):
    return dist.get_rank(), dist.get_world_size(), x


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return "fine"


def _hang_on_rank_one(woke: str):
    if dist.get_rank() == 1:
        time.sleep(60)
        open(woke, "w").close()  # reached only where the harness let the hung rank run on
    return "fine"


def test_harness_runs_collects_and_fails_fast(tmp_path):
    with DistPool(2, timeout=20, grace=3) as pool:
        assert pool.run(_rank_and_size, "x") == [(0, 2, "x"), (1, 2, "x")]
        with pytest.raises(DistributedTestError, match=r"rank 1 -----\nValueError: boom on rank one"):
            pool.run(_fail_on_rank_one)
        # the pool restarts after a failure
        assert pool.run(_rank_and_size, 1)[1] == (1, 2, 1)
        workers = list(pool._procs)
        with pytest.raises(DistributedTestTimeout, match=r"ranks \[1\] did not answer within 2s"):
            pool.run(_hang_on_rank_one, str(tmp_path / "woke"), timeout=2)
        # failed fast, without a clock (issue 42): the workers were killed, the hung rank before
        # its 60 s sleep ended
        assert not pool._procs and not any(p.is_alive() for p in workers)
        assert not (tmp_path / "woke").exists()


# ==================================================================================== collectives
def check_segment_collectives(seed: int) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = {}
    g = torch.Generator().manual_seed(seed)
    impls = {"all_to_all": AllToAllCollectives, "p2p": P2PCollectives, "two_phase": TwoPhaseCollectives}
    for kind, impl in impls.items():
        coll = collectives_for(group, kind)
        assert isinstance(coll, SegmentCollectives)
        assert isinstance(coll, impl)
        for trial in range(8):
            for dtype in (torch.float32, torch.bfloat16):
                # uneven chunk sizes, zeros included (same draw on every rank)
                sizes = torch.randint(0, 5, (W,), generator=g).tolist()
                if trial == 0:
                    sizes = [0] * W
                if trial == 7:  # one owner holds the whole block (gamma_B = W)
                    sizes = [0] * W
                    sizes[W - 1] = 17
                chunks = [torch.arange(n, dtype=torch.float32).to(dtype) + 100 * s + trial
                          for s, n in enumerate(sizes)]
                coll.counter.reset()
                recv_splits = [n if s != rank else 0 for s, n in enumerate(sizes)]
                recv = torch.full((sum(recv_splits),), -1.0, dtype=dtype)
                h = coll.all_gather_segments(chunks[rank], recv, recv_splits, async_op=trial % 2 == 0)
                h.wait()
                expect = torch.cat([chunks[s] for s in range(W) if s != rank])
                assert torch.equal(recv, expect), (kind, sizes, recv, expect)
                es = recv.element_size()
                N, c = sum(sizes), -(-sum(sizes) // W)
                if kind != "two_phase":
                    assert coll.counter.bytes_sent["all_gather_segments"] == sizes[rank] * (W - 1) * es
                    assert coll.counter.bytes_recv["all_gather_segments"] == sum(recv_splits) * es
                elif N:
                    # bounded by the ring volume plus this rank's own chunk, whatever the skew
                    sent = coll.counter.bytes_sent["two_phase_scatter"] + coll.counter.bytes_sent["two_phase_all_gather"]
                    assert sent <= (c * (W - 1) + sizes[rank]) * es

                # reduce-scatter: rank r contributes (r+1) * base to every destination chunk
                base = [torch.arange(n, dtype=torch.float32) + 2 * d for d, n in enumerate(sizes)]  # exact in bf16
                inp = torch.cat([b * (rank + 1) for b in base]).to(dtype)
                res = torch.empty(sizes[rank], dtype=dtype)
                h = coll.reduce_scatter_segments(res, inp, sizes, async_op=trial % 2 == 1)
                h.wait()
                expect = (base[rank] * sum(range(1, W + 1))).to(dtype)
                assert torch.equal(res, expect), (kind, sizes, res, expect)
                if kind != "two_phase":
                    assert coll.counter.calls == {"all_gather_segments": 1, "reduce_scatter": 1}
                    assert coll.counter.bytes_sent["reduce_scatter"] == (sum(sizes) - sizes[rank]) * es
                elif N:
                    recvd = coll.counter.bytes_recv["two_phase_reduce_scatter"] + coll.counter.bytes_recv["two_phase_gather"]
                    assert recvd <= (c * (W - 1) + sizes[rank]) * es
        out[kind] = "ok"
    # argument checks
    coll = collectives_for(group)
    with pytest.raises(ValueError, match="recv_splits"):
        coll.all_gather_segments(torch.ones(1), torch.empty(W), [1] * W, async_op=False)
    with pytest.raises(ValueError, match="splits"):
        coll.reduce_scatter_segments(torch.empty(1), torch.ones(W + 1), [1] * W, async_op=False)
    with pytest.raises(ValueError, match="kind must be one of"):
        collectives_for(group, "ring")
    return out


@pytest.mark.parametrize("W", [2, 3, 4])
def test_segment_collectives(W):
    res = get_pool(W).run(check_segment_collectives, seed=W)
    assert all(r == {"all_to_all": "ok", "p2p": "ok", "two_phase": "ok"} for r in res)


def test_agreement_on_a_process_group_that_moves_no_data_keeps_this_ranks_entry():
    """Under torch's fake process group (the dry run) every peer looks like this rank: digests
    agree and this rank's own error still raises (receive buffers start as its own entry)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from matrixfsdp.comm.agree import agree

    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        assert agree(fingerprint="abc") == ["abc"] * 8
        with pytest.raises(ValueError, match="boom"):
            agree(error="ValueError|boom")
    finally:
        dist.destroy_process_group()
