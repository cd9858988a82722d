"""Collectives on torch's fake backend (dry runs) take NCCL's list reduce-scatter, so a dry run
allocates what an NCCL job does: no P2P staging of ``W - 1`` chunks (issue 28)."""

from __future__ import annotations

import multiprocessing


def _reduce_on_fake() -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from matrixfsdp.comm.collectives import AllToAllCollectives

    dist.init_process_group("fake", rank=2, world_size=8, store=FakeStore())
    try:
        coll = AllToAllCollectives(dist.group.WORLD)
        calls = {"reduce_scatter": 0, "batch_isend_irecv": 0}
        orig = {k: getattr(dist, k) for k in calls}

        def spy(name):
            def f(*a, **k):
                calls[name] += 1
                return orig[name](*a, **k)
            return f

        for k in calls:
            setattr(dist, k, spy(k))
        try:
            splits = [3, 0, 5, 1, 0, 2, 7, 4]  # owners: uneven, some empty
            inp = torch.ones(sum(splits))
            out = torch.empty(splits[2])
            coll.reduce_scatter_segments(out, inp, splits, async_op=False)
        finally:
            for k, f in orig.items():
                setattr(dist, k, f)
        return {**calls, "sent": coll.counter.bytes_sent["reduce_scatter"]}
    finally:
        dist.destroy_process_group()


def test_fake_backend_reduces_with_the_list_form_and_counts_the_same_bytes():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_reduce_on_fake)
    # one list reduce_scatter, no fan-out; the bytes this rank sends: every chunk but its own
    assert out == {"reduce_scatter": 1, "batch_isend_irecv": 0, "sent": (22 - 5) * 4}, out
