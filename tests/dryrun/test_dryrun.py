"""The dry run (issue 28): sampled ranks of W-rank jobs through the real code on torch's fake
process group, as a user runs it (``python -m matrixfsdp.dryrun``, a process per sampled rank).

Anchored on the plan: what the sampled rank holds is what ``OwnerPlan.rank_stats`` predicts,
its gradients match its parameters, and the step makes no collective.

The command's ``main`` runs in this process, its ranks forked from the harness's forkserver
(``_dryrun_cli.py``: the same code and a fresh process per rank, without a torch import each);
``test_progress_per_sampled_rank_and_no_profiler_noise`` runs the real command, ranks spawned."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _dryrun_cli import in_process_cli

from matrixfsdp.planner.owner_plan import rank_held_bytes
from matrixfsdp.dryrun import REPLICATE_PLAN, preset_builder, sample_ranks
from matrixfsdp.planner.owners import plan_owners


@pytest.fixture
def cli(monkeypatch):
    """``cli(*argv)``: the exit status, stdout and stderr of ``python -m matrixfsdp.dryrun *argv``."""
    return in_process_cli(monkeypatch)


@pytest.fixture
def dryrun(cli):
    """``dryrun(*argv)``: the rows of ``python -m matrixfsdp.dryrun --json *argv`` (which must succeed)."""

    def run(*argv: str) -> list[dict]:
        status, out, err = cli("--json", *argv)
        assert status == 0, err[-3000:]
        return [json.loads(line) for line in out.splitlines()]

    return run


def _plan(world: int, replicas: int = 1, **kw):
    with torch.device("meta"):
        model, layers, _ = preset_builder("tiny", torch.float32)()
    S = world // replicas
    return plan_owners(model, (replicas, S) if replicas > 1 else S, block_types=layers, **kw)


@pytest.mark.parametrize("world, placement", [(64, "owned"), (64, "auto"), (1024, "auto")])
def test_flat_fully_shard_holds_what_the_plan_says_and_steps_as_planned(world, placement, dryrun):
    rows = dryrun("--world", str(world), "--dtype", "float32", "--placement", placement)
    plan = _plan(world, placement=placement)
    stats = plan.rank_stats
    max_block = max(sum(p.nbytes for p in plan.params_of_block(b)) for b in plan.blocks)
    assert (plan.num_hosted > 0) == (placement == "auto")  # the tiny preset at W >= 64 is past the budget
    assert [r["role"] for r in rows][0] == "most_loaded" and len({r["rank"] for r in rows}) == len(rows)
    for r in rows:
        assert r["param_bytes"] == stats[r["rank"]].nbytes, r  # exact: the plan is what ran
        assert r["grad_bytes"] == r["param_bytes"], r  # every tiny parameter trains
        # hosts keep their matrices' whole state (the plan does not size AdamW's 0-dim step counters)
        assert 0 <= r["state_bytes"] - stats[r["rank"]].state_nbytes <= 64, r
        if placement == "owned":
            assert r["comm"]["step"] == {}, r  # owners step what they hold: zero communication
        else:  # hosted matrices: two fused all-to-alls per micro-group, nothing else
            assert set(r["comm"]["step"]) == {"all_to_all_single"}, r
            assert r["comm"]["step"]["all_to_all_single"]["calls"] == 2 * len(plan.host_groups), r
        assert sum(v["sent"] + v["recv"] for v in r["comm"]["forward"].values()) > 0, r
        assert r["peak_bytes"] >= r["param_bytes"] + r["grad_bytes"], r
        # the allocator's peak sees a whole layer materialized (its buffers are storage-resized)
        assert r["peak_bytes"] >= r["param_bytes"] + max_block, r
    worst = rows[0]
    # the most loaded rank by plan (parameter + gradient + state bytes) is the one the table names
    load = rank_held_bytes(plan.params, world)
    assert load[worst["rank"]] == max(load)
    assert worst["param_ratio"] == pytest.approx(stats[worst["rank"]].nbytes / (sum(p.nbytes for p in plan.params) / world))


def test_hsdp_dry_run_matches_the_plan_per_shard_coordinate(dryrun):
    rows = dryrun("--world", "64", "--replicas", "8", "--dtype", "float32")
    stats = _plan(64, 8).rank_stats
    for r in rows:
        assert r["replicas"] == 8 and r["param_bytes"] == stats[r["rank"] % 8].nbytes, r
        assert r["comm"]["step"] == {}, r
        assert "all_gather_tensors" in r["comm"]["forward"] or r["comm"]["forward"], r


def test_replicate_dry_run_holds_every_parameter_and_steps_without_collectives(dryrun):
    rows = dryrun("--world", "8", "--front-end", "replicate", "--dtype", "float32", "--roles", "most_loaded")
    plan = _plan(8, **REPLICATE_PLAN)
    total = sum(p.nbytes for p in plan.params)
    (r,) = rows
    assert r["param_bytes"] == total and r["param_ratio"] == pytest.approx(8.0), r
    assert r["comm"]["step"] == {}, r
    # the second step's forward brings the owners' new values: replicate's parameter exchange
    assert sum(v["recv"] for v in r["comm"]["forward"].values()) > 0, r


def test_sampled_ranks_follow_the_planned_load():
    build = preset_builder("tiny", torch.float32)
    picks = sample_ranks(build, 64)
    plan = _plan(64)
    load = rank_held_bytes(plan.params, 64)  # parameter + gradient + state bytes
    assert load[picks["most_loaded"]] == max(load) and picks["rank0"] == 0
    assert sorted(load)[32] == load[picks["median"]]


def test_bad_input_is_refused_with_the_value_seen(cli):
    status, _, err = cli("--world", "64", "--replicas", "5")
    assert status == 2
    assert "world size must be a positive multiple of the replicas, got world_size=64, replicas=5" in err
    with pytest.raises(ValueError, match="unknown model 'qwen9'"):
        preset_builder("qwen9")
    with pytest.raises(ValueError, match=r"unknown roles \['slowest'\]"):
        sample_ranks(preset_builder("tiny"), 8, roles=("slowest",))


def test_a_dry_run_refuses_a_process_with_a_process_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from matrixfsdp.dryrun import run_rank

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(ValueError, match="a process group is already initialized in this process"):
            run_rank(preset_builder("tiny"), name="tiny", world_size=2, rank=0, role="rank0")
    finally:
        dist.destroy_process_group()


def test_fsdp2_tp_dry_run_holds_its_tp_shards_of_the_owned_matrices(dryrun):
    """``--tp 2``: a (dp_shard, tp) mesh, the preset's MLPs tensor-parallel; each sampled rank (TP
    rank 0 of its data-parallel rank) holds, to the byte, its TP shard of what its owner row is
    planned to hold, and the step makes only the TP host step's all-to-alls."""
    from matrixfsdp.dryrun import tp_fractions

    rows = dryrun("--world", "16", "--tp", "2", "--dtype", "float32")
    with torch.device("meta"):
        model, layers, _ = preset_builder("tiny", torch.float32)()
    frac = tp_fractions(model, 2)
    assert frac and all(f == 0.5 for f in frac.values())  # gate/up/down of every MLP, split in two
    plan = plan_owners(model, 8, block_types=layers, tp=2)
    for r in rows:
        d = r["rank"] // 2
        assert r["rank"] % 2 == 0 and r["tp"] == 2, r
        assert r["param_bytes"] == sum(p.share(d, 8) * p.nbytes * frac.get(p.fqn, 1.0) for p in plan.params), r
        assert set(r["comm"]["step"]) <= {"all_to_all_single"}, r
    assert any(r["comm"]["step"] for r in rows)  # some sampled owner row steps a TP matrix


def test_bad_tp_input_is_refused_with_a_reason(cli):
    for args, needle in ((["--world", "16", "--tp", "3"], "tp must be an int >= 1 dividing the world size"),
                         (["--world", "16", "--tp", "2", "--replicas", "2"], "run HSDP and TP separately"),
                         (["--world", "16", "--tp", "2", "--front-end", "replicate"], "FSDP2 + TP")):
        status, _, err = cli(*args)
        assert status == 2 and needle in err, (args, err[-2000:])


def test_progress_per_sampled_rank_and_no_profiler_noise():
    """The dry run used to run for minutes without output at large W, and print kineto's
    profiler lines and a FutureWarning a user cannot act on: now stderr names each sampled
    rank's phases (a tqdm bar on a terminal, a line per phase here) and nothing else; Shampoo
    and SOAP are accepted (planned for their own state)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "matrixfsdp.dryrun", "--model", "tiny", "--world", "4",
                          "--roles", "rank0", "--steps", "1", "--optimizer", "shampoo"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.splitlines() == [f"dryrun: rank 0 (rank0): {ph}" for ph in
                                       ("starting", "planning", "sharding", "to_empty", "step 1/1", "done")]
    assert "tiny, fully_shard, mesh 4, bfloat16, shampoo" in out.stdout
    from matrixfsdp.dryrun.__main__ import build_parser

    assert build_parser().parse_args(["--world", "4", "--optimizer", "soap"]).optimizer == "soap"
