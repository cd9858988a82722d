"""Property tests of the pure segment math (``matrixfsdp.engine.layout``), plus a simulated exchange.

The simulation runs the exact buffer recipe the runtime uses (chunks, gather splits, assembled
copies, rank-major reduce buffers with usage flags) over W in-process "ranks" with plain tensors,
so the layout is checked end to end without a process group.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixfsdp.engine.layout import BlockLayout
from matrixfsdp.planner.owner_plan import ParamPlan


@st.composite
def block_params(draw, max_params: int = 6):
    W = draw(st.integers(1, 6))
    n = draw(st.integers(0, max_params))
    params = []
    for i in range(n):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0 if ndim > 1 else 1, 9)) for _ in range(ndim))
        if ndim == 0:
            placement = "tail"
        else:
            placement = draw(st.sampled_from(["even", "tail"] + (["matrix"] if ndim == 2 else [])))
        owner = None if placement == "even" else draw(st.integers(0, W - 1))
        params.append(ParamPlan(
            fqn=f"p{i}", placement=placement, owner=owner, block="b", shape=shape,
            dtype="float32", nbytes=4 * math.prod(shape), state_nbytes=0, cost=0.0,
        ))
    return W, params


@given(block_params())
@settings(max_examples=300, deadline=None)
def test_pieces_tile_each_param_exactly_once(case):
    W, params = case
    lay = BlockLayout.from_plans(params, W)
    for i, p in enumerate(params):
        covered = torch.zeros(p.numel, dtype=torch.int32)
        for q in lay.pieces_of_param(i):
            assert q.numel > 0
            assert q.numel == (q.row_end - q.row_start) * lay.params[i].row_numel
            covered[q.flat_start: q.flat_start + q.numel] += 1
            # a piece is what the plan says the rank stores
            assert (q.row_start, q.row_end) == p.local_rows(q.rank, W)
            assert lay.params[i].local_shape(q.rank) == p.local_shape(q.rank, W)
        assert bool((covered == 1).all()), (p, lay.pieces_of_param(i))
        # ranks hold rows in rank order
        ranks = [q.rank for q in lay.pieces_of_param(i)]
        assert ranks == sorted(ranks)
        if p.owner is not None and p.numel:
            assert ranks == [p.owner]


@given(block_params())
@settings(max_examples=300, deadline=None)
def test_chunks_are_contiguous_and_sized(case):
    W, params = case
    lay = BlockLayout.from_plans(params, W)
    for r in range(W):
        off = 0
        for q in lay.pieces_of_rank(r):
            assert q.offset == off
            off += q.numel
        assert off == lay.chunk_numel[r]
        expect = sum(math.prod(p.local_shape(r, W)) for p in params)
        assert lay.chunk_numel[r] == expect
    assert sum(lay.chunk_numel) == lay.numel == sum(p.numel for p in params)


@given(block_params())
@settings(max_examples=300, deadline=None)
def test_gather_splits_agree_between_senders_and_receivers(case):
    W, params = case
    lay = BlockLayout.from_plans(params, W)
    splits = [lay.gather_splits(r) for r in range(W)]
    for r in range(W):
        assert splits[r].input_splits[r] == 0 and splits[r].output_splits[r] == 0
        for s in range(W):
            if s != r:
                # what s sends to r is what r expects from s
                assert splits[s].input_splits[r] == splits[r].output_splits[s] == lay.chunk_numel[s]
        assert splits[r].recv_numel == lay.numel - lay.chunk_numel[r]
        offs = splits[r].recv_offsets
        assert list(offs) == [sum(splits[r].output_splits[:s]) for s in range(W)]
    # total bytes moved = every non-empty piece, once to each of the W-1 peers
    sent = sum(lay.gather_bytes(r, 4)[0] for r in range(W))
    recv = sum(lay.gather_bytes(r, 4)[1] for r in range(W))
    assert sent == recv == 4 * (W - 1) * sum(q.numel for q in lay.pieces)


@given(block_params(), st.integers(0, 4))
@settings(max_examples=200, deadline=None)
def test_reduce_splits_and_bytes(case, extra):
    W, params = case
    lay = BlockLayout.from_plans(params, W)
    splits = lay.reduce_splits(extra)
    assert splits == tuple(n + extra for n in lay.chunk_numel)
    assert lay.reduce_offsets(extra) == tuple(sum(splits[:d]) for d in range(W))
    total = sum(splits)
    sent = [lay.reduce_bytes(r, 4, extra)[0] for r in range(W)]
    recv = [lay.reduce_bytes(r, 4, extra)[1] for r in range(W)]
    # summed over ranks, a direct reduce-scatter moves what a ring reduce-scatter moves
    assert sum(sent) == sum(recv) == 4 * (W - 1) * total


@given(block_params(), st.integers(0, 9), st.sampled_from([1, 2, 4, 8, 16, 32]))
@settings(max_examples=200, deadline=None)
def test_aligned_reduce_splits(case, extra, itemsize):
    """[Note: aligned reduce chunks]: every destination chunk starts at a multiple of 16 bytes;
    the padding after the flags is the least that does it (< 16 bytes per destination)."""
    from matrixfsdp.engine.layout import ALIGN_BYTES

    W, params = case
    lay = BlockLayout.from_plans(params, W)
    splits = lay.reduce_splits(extra, itemsize=itemsize)
    step = max(1, ALIGN_BYTES // itemsize)
    for d, (s, n) in enumerate(zip(splits, lay.chunk_numel)):
        assert s >= n + extra and s - (n + extra) < step
        assert (s * itemsize) % ALIGN_BYTES == 0 or itemsize > ALIGN_BYTES
    for off in lay.reduce_offsets(extra, itemsize=itemsize):
        assert (off * itemsize) % ALIGN_BYTES == 0
    sent = [lay.reduce_bytes(r, itemsize, extra, aligned=True)[0] for r in range(W)]
    assert sum(sent) == itemsize * (W - 1) * sum(splits)


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
@pytest.mark.parametrize("W", [8, 16])
def test_qwen3_reduce_chunks_aligned(preset, W):
    """Every chunk start of every block of a Qwen3 preset's plan is 16-byte aligned in bf16 and
    fp32 (pure layout math); unpadded, most of them would not be (the flag block shifts them)."""
    from matrixfsdp import plan_owners
    from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer

    with torch.device("meta"):
        model = Decoder(PRESETS[preset]).to(torch.bfloat16)
    plan = plan_owners(model, W, block_types=(DecoderLayer,))
    blocks = sorted({p.block for p in plan.params})
    starts = misaligned_bare = 0
    for b in blocks:
        lay = BlockLayout.from_plans([p for p in plan.params if p.block == b], W)
        F = len(lay.params)
        for isz in (2, 4):
            for off in lay.reduce_offsets(F, itemsize=isz):
                starts += 1
                assert (off * isz) % 16 == 0, (b, isz, off)
            misaligned_bare += sum((off * isz) % 16 != 0 for off in lay.reduce_offsets(F))
    assert starts == 2 * len(blocks) * W
    assert misaligned_bare > starts // 4  # what the padding fixes (the finding)


@given(block_params())
@settings(max_examples=150, deadline=None)
def test_simulated_gather_and_reduce_roundtrip(case):
    """Run the runtime's buffer recipe over W simulated ranks with plain tensors."""
    W, params = case
    lay = BlockLayout.from_plans(params, W)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(p.shape, generator=g) for p in params]
    locals_ = [[f[slice(*p.local_rows(r, W))] if f.ndim else (f if p.owner == r else f.new_empty(0))
                for f, p in zip(full, params)] for r in range(W)]
    chunks = []
    for r in range(W):
        qs = lay.pieces_of_rank(r)
        chunks.append(torch.cat([locals_[r][q.param].reshape(-1) for q in qs]) if qs
                      else torch.empty(0))
    for r in range(W):
        sp = lay.gather_splits(r)
        recv = torch.cat([chunks[s] for s in range(W) if s != r]) if W > 1 else torch.empty(0)
        assert recv.numel() == sp.recv_numel
        assembled = torch.full((lay.assembled_numel,), float("nan"))
        for i, p in enumerate(lay.params):
            off = lay.assembled_offset(i)
            if off is None:
                q = lay.single_piece(i)
                if q is None:
                    assert p.numel == 0
                    continue
                if q.rank == r:
                    got = locals_[r][i].reshape(p.shape)
                else:
                    start = sp.recv_offsets[q.rank] + q.offset
                    got = recv[start: start + q.numel].view(p.shape)
            else:
                for q in lay.pieces_of_param(i):
                    src = (locals_[r][i].reshape(-1) if q.rank == r else
                           recv[sp.recv_offsets[q.rank] + q.offset:][: q.numel])
                    assembled[off + q.flat_start: off + q.flat_start + q.numel] = src
                got = assembled[off: off + p.numel].view(p.shape)
            assert torch.equal(got, full[i])
    # reduction: rank-major buffers with one flag per param, summed per destination
    F = len(params)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(W)]
    bufs = []
    for r in range(W):
        parts = []
        for d in range(W):
            for q in lay.pieces_of_rank(d):
                parts.append(grads[r][q.param].reshape(-1)[q.flat_start: q.flat_start + q.numel])
            parts.append(torch.ones(F))
            parts.append(torch.zeros(lay.reduce_splits(F, itemsize=4)[d] - lay.chunk_numel[d] - F))
        bufs.append(torch.cat(parts) if parts else torch.empty(0))
    splits = lay.reduce_splits(F, itemsize=4)
    summed = torch.stack(bufs).sum(0) if W else None
    for d in range(W):
        off = lay.reduce_offsets(F, itemsize=4)[d]
        out = summed[off: off + splits[d]]
        n = lay.chunk_numel[d]
        assert torch.equal(out[n: n + F], torch.full((F,), float(W)))
        assert not out[n + F:].any()
        for q in lay.pieces_of_rank(d):
            exp = sum(grads[r][q.param] for r in range(W)).reshape(-1)[q.flat_start: q.flat_start + q.numel]
            torch.testing.assert_close(out[q.offset: q.offset + q.numel], exp)


def test_rejects_rows_that_do_not_tile():
    from matrixfsdp.engine.layout import ParamLayout

    with pytest.raises(ValueError, match="do not tile"):
        BlockLayout(world_size=2, params=(ParamLayout("w", (4, 2), None, ((0, 2), (3, 4))),))
    with pytest.raises(ValueError, match="row ranges"):
        BlockLayout(world_size=2, params=(ParamLayout("w", (4, 2), None, ((0, 4),)),))


def test_owned_matrix_layout_example():
    """A worked example: W=3, a 4x2 matrix owned by rank 1 and a 5-row even param."""
    ps = [
        ParamPlan(fqn="m", placement="matrix", owner=1, block="b", shape=(4, 2), dtype="float32",
                  nbytes=32, state_nbytes=0, cost=0.0),
        ParamPlan(fqn="e", placement="even", owner=None, block="b", shape=(5,), dtype="float32",
                  nbytes=20, state_nbytes=0, cost=0.0),
    ]
    lay = BlockLayout.from_plans(ps, 3)
    assert lay.chunk_numel == (2, 8 + 2, 1)  # even: chunk 2 -> rows [0,2) [2,4) [4,5)
    assert lay.gather_splits(0).output_splits == (0, 10, 1)
    assert lay.gather_splits(1).input_splits == (10, 0, 10)
    assert lay.single_piece(0).rank == 1 and lay.assembled_offset(1) == 0
    assert lay.assembled_numel == 5


@st.composite
def any_placement_params(draw):
    """Blocks of every placement, experts and hosted matrices included, over up to 40 ranks."""
    W = draw(st.integers(1, 40))
    params = []
    for i in range(draw(st.integers(0, 6))):
        placement = draw(st.sampled_from(["even", "hosted", "matrix", "tail", "experts"]))
        if placement == "experts":
            E = draw(st.integers(1, 12))
            counts = [0] * W  # E experts dealt to random ranks: runs of equal counts, zeros between
            for _ in range(E):
                counts[draw(st.integers(0, W - 1))] += 1
            shape, extra = (E, draw(st.integers(1, 4)), 3), {"experts": tuple(counts)}
        else:
            ndim = 2 if placement in ("matrix", "hosted") else draw(st.integers(1, 3))
            shape = tuple(draw(st.integers(1 if placement in ("even", "hosted") and d == 0 else 0, 90))
                          for d in range(ndim))
            extra = {"host": draw(st.integers(0, W - 1))} if placement == "hosted" else {}
        owner = draw(st.integers(0, W - 1)) if placement in ("matrix", "tail") else None
        params.append(ParamPlan(fqn=f"p{i}", placement=placement, owner=owner, block="b", shape=shape,
                                dtype="float32", nbytes=4 * math.prod(shape), state_nbytes=0, cost=0.0, **extra))
    return W, params


def _pieces_rank_by_rank(params, W):
    """The layout's pieces the way they were listed before spans: every (rank, parameter)."""
    out = []
    for r in range(W):
        offset = 0
        for i, p in enumerate(params):
            start, end = p.local_rows(r, W)
            rn = math.prod(p.shape[1:]) if p.shape else 1
            if end == start or rn == 0:
                continue
            out.append((i, r, start, end, start * rn, (end - start) * rn, offset))
            offset += (end - start) * rn
    return out


@given(any_placement_params())
@settings(max_examples=200, deadline=None)
def test_spans_list_exactly_the_pieces_of_every_rank(case):
    """[Note: spans]: the runs and spans describe every rank's rows, pieces and chunk as listing them
    rank by rank does (every placement), with spans cut where the ranks' chunks differ."""
    import dataclasses

    W, params = case
    lay = BlockLayout.from_plans(params, W)
    for i, p in enumerate(params):
        assert tuple(lay.params[i].rows) == tuple(p.local_rows(r, W) for r in range(W))
        assert lay.params[i].rows[W - 1] == p.local_rows(W - 1, W)
    ref = _pieces_rank_by_rank(params, W)
    assert [dataclasses.astuple(q) for q in lay.pieces] == ref
    for r in range(W):
        assert [dataclasses.astuple(q) for q in lay.pieces_of_rank(r)] == [q for q in ref if q[1] == r]
    for i in range(len(params)):
        mine = [q for q in ref if q[0] == i]
        assert [dataclasses.astuple(q) for q in lay.pieces_of_param(i)] == mine
        assert lay.piece_count(i) == len(mine)
        assert sum(s.hi - s.lo for s, _ in lay.param_spans(i)) == len(mine)
    spans = lay.spans
    assert spans[0].lo == 0 and spans[-1].hi == W and all(a.hi == b.lo for a, b in zip(spans, spans[1:]))
    for s in spans:
        assert all(lay.chunk_numel[d] == s.chunk for d in range(s.lo, s.hi))
        assert lay.span_of(s.lo) is s and lay.span_of(s.hi - 1) is s


def test_spans_of_a_large_world_stay_few():
    """An evenly sharded block at W=4096 is a handful of spans, not 4096 pieces per parameter."""
    W = 4096
    specs = [("q", "hosted", (4096, 4096)), ("n", "even", (128,)), ("e", "even", (151936, 64)),
             ("o", "matrix", (64, 64))]
    ps = [ParamPlan(fqn=f, placement=pl, owner=7 if pl == "matrix" else None, block="b", shape=sh,
                    dtype="float32", nbytes=4 * math.prod(sh), state_nbytes=0, cost=0.0,
                    **({"host": 3} if pl == "hosted" else {})) for f, pl, sh in specs]
    lay = BlockLayout.from_plans(ps, W)
    assert len(lay.spans) <= 2 * len(ps) + 1, lay.spans
    # torch.chunk: 38 rows on ranks 0..3997, 12 on 3998, none after
    assert lay.piece_count(2) == 3999 and lay.piece_count(1) == 128 and lay.piece_count(3) == 1
    assert lay.chunk_numel[7] == 4096 + 1 + 38 * 64 + 64 * 64 and sum(lay.chunk_numel) == lay.numel
