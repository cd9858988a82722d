"""The copy-out by spans (issue 44) puts every peer's piece where it belongs, bitwise.

A block's peers of one span of alike ranks are copied out of the receive buffer as one strided
view ([Note: spans] in ``engine/layout.py``); a wrong stride or offset would assemble a wrong
parameter. Every rank of a W=8 job is run in turn on torch's fake process group with its
gather replaced by the true one (every peer's chunk, cut from the full parameters by the
layout), and each unsharded parameter must equal the full one. The plan makes the root's
matrices and some block parameters evenly sharded and leaves owners in between, so spans of
several peers (strided copies), single peers and spans holding this rank all occur.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from _models import TinyConfig, TinyDecoder, make_plan

from matrixfsdp._fully_shard import fully_shard
from matrixfsdp._fully_shard.init import get_state
from matrixfsdp.comm.collectives import Handle

W = 8
EVEN = ("blocks.0.up.weight", "blocks.1.wo.bias", "blocks.2.mlp_norm.weight", "blocks.2.down.bias")


class TrueGather:
    """A block's all-gather as the real one delivers it: peers' chunks in rank order, none of this
    rank's own, each chunk its pieces of the full parameters in chunk order."""

    def __init__(self, group, full: list[torch.Tensor], rank: int):
        self.group, self.full, self.rank = group, full, rank
        self.world_size = W

    def all_gather_segments(self, send, recv, output_splits, async_op=False):
        lay = self.group.layout
        chunks = [torch.cat([self.full[q.param].reshape(-1)[q.flat_start: q.flat_start + q.numel]
                             for q in lay.pieces_of_rank(s)] or [recv.new_empty(0)])
                  for s in range(W) if s != self.rank]
        assert list(output_splits) == [lay.chunk_numel[s] if s != self.rank else 0 for s in range(W)]
        recv.copy_(torch.cat(chunks))
        return Handle()


def test_copy_out_by_spans_assembles_every_parameter_on_every_rank():
    strided = 0
    for rank in range(W):
        dist.init_process_group("fake", rank=rank, world_size=W, store=FakeStore())
        try:
            model = TinyDecoder(TinyConfig(), seed=0)
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
            plan = make_plan(model, W, root_matrices="even", even=EVEN)
            mesh = init_device_mesh("cpu", (W,))
            for b in model.blocks:
                fully_shard(b, mesh=mesh, plan=plan)
            fully_shard(model, mesh=mesh, plan=plan)
            for _, m in model.named_modules():
                state = get_state(m)
                if state is None:
                    continue
                g = state.group
                strided += len(g._out_copy[1][0])
                g.coll = TrueGather(g, [full[mp.fqn] for mp in g.params], rank)
                g.unshard(async_op=False)
                g.wait_for_unshard()
                for mp in g.params:
                    assert torch.equal(mp.unsharded.detach(), full[mp.fqn]), (rank, mp.fqn)
                g.reshard()
        finally:
            dist.destroy_process_group()
    assert strided > 0  # some span of several peers was copied out as one strided view
