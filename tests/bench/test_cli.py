"""Benchmark scripts: headers record the command actually run, --out keeps stdout to a summary,
planner_quality writes rows as it goes, step_balance measures (no committed results read).

step_bench's driver and planner_quality run their ``main(argv)`` in this process (``_main``): a
benchmark interpreter pays a torch + matrixfsdp import (~4.5 s CPU) before any work. step_bench's
ranks are still processes of their own, started by the driver as from the command line.
expert_ns_bench runs here too (its thread count restored after); step_balance, which sets the
thread count and then forks its ranks from its own process, and plot_zero run as subprocesses
(``_bench``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _import_bench(name: str):
    """benchmarks/<name>.py as a module of this process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _main(script: str, *args: str) -> str:
    """``python benchmarks/<script> *args`` as its ``main(args)`` in this process (which must
    return 0); what it printed on stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = _import_bench(script.removesuffix(".py")).main(list(args))
    assert status == 0, out.getvalue()[-3000:]
    return out.getvalue()


def _step_bench_rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """A step_bench rank forked from the harness's forkserver: the launcher's environment, output
    to ``log``, then the script's worker; ends the process as the script's ``__main__`` does."""
    f = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, 1)
    os.dup2(f, 2)
    os.environ.update(env)
    code = _import_bench("step_bench").main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _forked_launch_ranks(world: int, worker_argv: list[str], *, store_path: str, threads: int, timeout_s: float,
                         netns_prefix: str | None = None, gloo_ifname: str | None = None,
                         extra_env: dict[str, str] | None = None) -> list[int]:
    """``_bench_common.launch_ranks`` for step_bench in this process: the same rank environment
    and worker argv, the ranks forked from the harness's forkserver (torch and matrixfsdp
    imported, nothing run) instead of fresh interpreters; a failed rank's output is printed."""
    import time

    from _harness import forkserver_context

    assert netns_prefix is None and gloo_ifname is None and list(worker_argv[1:3]) == [
        str(ROOT / "benchmarks" / "step_bench.py"), "--_worker"], worker_argv
    ctx = forkserver_context()
    logs = [f"{store_path}.rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        env = {"MFB_RANK": str(r), "MFB_WORLD": str(world), "MFB_STORE": store_path, "OMP_NUM_THREADS": str(threads),
               **(extra_env or {})}
        argv = list(worker_argv[2:]) + ["--_rank", str(r)]
        procs.append(ctx.Process(target=_step_bench_rank, args=(argv, env, logs[r])))
        procs[-1].start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    for r, code in enumerate(codes):
        if code:
            print(f"----- step_bench rank {r} exited with {code} -----\n{Path(logs[r]).read_text()}", file=sys.stderr)
    return codes


def _step_bench(*args: str) -> str:
    """``python benchmarks/step_bench.py *args`` (the driver, which must succeed) in this process,
    its ranks forked from the harness's forkserver by ``_forked_launch_ranks``; its stdout.
    test_step_bench_zero_rows_run_and_match_ddp runs the script's own launcher."""
    bc = _import_bench("_bench_common")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bc, "launch_ranks", _forked_launch_ranks)
        return _main("step_bench.py", *args)


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_planner_quality_header_stdout_and_rows(tmp_path):
    out = tmp_path / "pq"
    stdout = _main("planner_quality.py", "--models", "tiny", "--worlds", "2", "3", "--out", str(out))
    md = (tmp_path / "pq.md").read_text()
    assert md.splitlines()[0] == (f"<!-- produced by: python benchmarks/planner_quality.py --models tiny "
                                  f"--worlds 2 3 --out {out} -->")
    assert not any(line.startswith("{") for line in stdout.splitlines())  # summary only
    assert "| tiny | 2 |" in stdout
    rows = [json.loads(line) for line in (tmp_path / "pq.jsonl").read_text().splitlines()]
    assert [r["world"] for r in rows] == [2, 3]


def test_step_balance_measures(tmp_path):
    src = (ROOT / "benchmarks" / "step_balance.py").read_text()
    assert "step_cpu_w" not in src and "results" not in src.split('"""', 2)[2]  # reads no committed results
    out = tmp_path / "sb"
    res = _bench("step_balance.py", "--worlds", "2", "--reps", "1", "--out", str(out))  # measures; 1 rep is enough
    row = json.loads((tmp_path / "sb.jsonl").read_text())
    assert row["world"] == 2 and row["distributed_step_s"] > 0 and len(row["distributed_local_step_s"]) == 2
    assert (tmp_path / "sb.md").read_text().startswith(
        f"<!-- produced by: python benchmarks/step_balance.py --worlds 2 --reps 1 --out {out} -->")
    assert not any(line.startswith("{") for line in res.stdout.splitlines())


def test_step_bench_zero_rows_run_and_match_ddp(tmp_path):
    """The issue-12 rows of step_bench on a small model: they run, match ddp_muon's parameters,
    make no collective in the optimizer step (replicate) and report their step balance."""
    out = tmp_path / "sb"
    _main("step_bench.py", "--world", "2", "--impls", "ddp_muon,replicate_a0.5,replicate_naive,zero_redundancy_muon",
           "--repeats", "1", "--warmup", "2", "--steps", "1", "--parity-steps", "2", "--retries", "0",
           "--max-foreign", "1.0", "--quiet-wait", "0", "--hidden", "64", "--intermediate", "128", "--layers", "2",
           "--vocab", "256", "--seq", "32", "--heads", "2", "--kv-heads", "1", "--out", str(out))
    rows = {r["impl"]: r for r in map(json.loads, (tmp_path / "sb.jsonl").read_text().splitlines()) if "impl" in r}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    for name in ("replicate_a0.5", "replicate_naive", "zero_redundancy_muon"):
        assert rows[name]["parity"]["max_abs_diff"] <= 1e-6, rows[name]["parity"]
        assert rows[name]["step_balance"] >= 1.0
    for name in ("replicate_a0.5", "replicate_naive"):
        assert all(c["step"]["calls"] == 0 for c in rows[name]["comm_per_rank"])
    assert "Sharded optimizer steps against their balance limit" in (tmp_path / "sb.md").read_text()


def test_plot_zero_reads_step_bench_results(tmp_path):
    res = _bench("plot_zero.py", "benchmarks/results/zero/step_cpu_w4_zero.jsonl", "--out", str(tmp_path / "z.png"))
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert (tmp_path / "z.png").stat().st_size > 10_000
    assert {r["impl"] for r in rows} >= {"replicate_a0.5", "zero1_owner", "zero_redundancy_muon"}
    assert all(r["limit"] > 0 and r["balance"] >= 1.0 for r in rows)


def _hsdp_api() -> bool:
    import inspect

    import matrixfsdp

    return "replica_step" in inspect.signature(matrixfsdp.plan_owners).parameters


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    """step_bench --mesh 2,2 on localhost gloo (no netns), one tiny config, every HSDP row."""
    out = tmp_path_factory.mktemp("hsdp") / "hb"
    _step_bench("--world", "4", "--mesh", "2,2", "--repeats", "1", "--warmup", "2", "--steps", "1",
                "--parity-steps", "2", "--retries", "0", "--max-foreign", "1.0", "--quiet-wait", "0",
                "--link-check-mb", "0.25", "--hidden", "64", "--intermediate", "128", "--layers", "2", "--vocab", "256",
                "--seq", "32", "--heads", "2", "--kv-heads", "1", "--out", str(out))
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    rows = {r["impl"]: r for r in lines if "impl" in r}
    md = out.with_suffix(".md").read_text()
    # --render rewrites the same report
    assert _import_bench("step_bench").main(["--render", str(out.with_suffix(".jsonl"))]) == 0
    assert out.with_suffix(".md").read_text() == md
    return lines[0]["meta"], rows, md


def test_step_bench_hsdp_rows_well_formed(hsdp_run):
    """The issue-17 HSDP rows: torch HSDP baselines run on the (2, 2) mesh, match the single-process
    run (Muon baselines), report ratios to hsdp_adamw, bytes per phase, the link check and the
    alone step; the matrixfsdp rows are present (run, or skipped saying why)."""
    meta, rows, md = hsdp_run
    assert meta["mesh"] == [2, 2] and meta["args"]["reference"] == "hsdp_adamw"
    assert set(meta["link_check"]) == {"within shard group 0->1", "across replicas 0->2",
                                       "across replicas, all pairs at once"}
    assert all(v["mbit_s_per_pair"] > 0 for v in meta["link_check"].values())
    assert len(meta["alone_step_s"]) == 1 and meta["alone_step_s"][0] > 0
    assert set(rows) == {"single_muon", "hsdp_adamw", "hsdp_distmuon", "hsdp_gather_muon", "mfsdp_repeat", "mfsdp_split"}
    for name in ("single_muon", "hsdp_adamw", "hsdp_distmuon", "hsdp_gather_muon"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["fb_s"] > 0 and r["step_s"] > 0 and len(r["comm_per_rank"]) == 4
        if name != "hsdp_adamw":
            assert "hsdp_adamw" in r["ratios"]["fb_s"]
    for name in ("hsdp_distmuon", "hsdp_gather_muon"):
        assert rows[name]["parity"]["max_abs_diff"] <= 1e-5, rows[name]["parity"]
        assert all(c["step"]["calls"] > 0 for c in rows[name]["comm_per_rank"])  # within the shard group
    # torch HSDP: the cross-replica all-reduce in backward, nothing in the step
    assert all("all_reduce" in c["bwd"]["ops"] and c["step"]["calls"] == 0 for c in rows["hsdp_adamw"]["comm_per_rank"])
    assert all(c["fwd"]["calls"] == c["bwd"]["calls"] == 0 for c in rows["single_muon"]["comm_per_rank"])
    assert "### HSDP targets (issue 17)" in md and "Measured link throughput" in md
    if not _hsdp_api():
        for name in ("mfsdp_repeat", "mfsdp_split"):
            assert rows[name]["status"] == "skipped" and "replica_step" in rows[name]["reason"], rows[name]


def test_step_bench_hsdp_matrixfsdp_rows(hsdp_run):
    if not _hsdp_api():
        pytest.skip("matrixfsdp.plan_owners has no replica_step yet (issue 17's HSDP runtime not merged)")
    _, rows, _ = hsdp_run
    for name in ("mfsdp_repeat", "mfsdp_split"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert all(c["step"]["calls"] == 0 for c in r["comm_per_rank"]), r["comm_per_rank"]
        assert r["parity"]["max_abs_diff"] <= 1e-5, r["parity"]
        assert "hsdp_adamw" in r["ratios"]["fb_s"]


def test_step_bench_tp_rows_well_formed(tmp_path):
    """``--tp 2`` (issue 18, dp=1) on a tiny Decoder: the five TP rows run; the hosted rows make
    two all-to-alls per micro-group in the step (unfused: one group per matrix) and match the
    redundant baseline, which all-gathers every TP-sharded matrix; the report states the targets."""
    out = tmp_path / "tp"
    _step_bench("--tp", "2", "--repeats", "1", "--warmup", "2", "--steps", "1", "--parity-steps", "2",
                "--retries", "0", "--max-foreign", "1.0", "--quiet-wait", "0", "--hidden", "64", "--intermediate", "128",
                "--layers", "1", "--vocab", "384", "--seq", "8", "--global-batch", "2", "--out", str(out))
    lines = [json.loads(line) for line in (tmp_path / "tp.jsonl").read_text().splitlines()]
    meta, rows = lines[0]["meta"], {r["impl"]: r for r in lines[1:]}
    assert meta["tp"] == 2 and meta["dp"] == 1 and meta["world"] == 2
    assert list(rows) == ["tp_redundant", "tp_microgroups", "tp_sequential", "tp_unfused", "tp_shard_local"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    n_mats = 7  # q, k, v, o, gate, up, down of the one layer

    def step_ops(r):
        return r["comm_per_rank"][0]["step"]["ops"]

    assert set(step_ops(rows["tp_redundant"])) == {"all_gather_single"}
    assert step_ops(rows["tp_redundant"])["all_gather_single"][0] == n_mats
    assert rows["tp_unfused"]["micro_groups"] == n_mats
    for name in ("tp_microgroups", "tp_sequential", "tp_unfused"):
        r = rows[name]
        assert set(step_ops(r)) == {"all_to_all_single"}, step_ops(r)
        assert step_ops(r)["all_to_all_single"][0] == 2 * r["micro_groups"]
        assert r["parity"]["max_abs_diff"] <= 1e-5, r["parity"]
        assert r["ratios"]["step_s"]["tp_redundant"] > 0
    assert rows["tp_microgroups"]["micro_groups"] == rows["tp_sequential"]["micro_groups"] < n_mats
    assert rows["tp_shard_local"]["comm_per_rank"][0]["step"]["calls"] == 0
    assert rows["tp_shard_local"]["parity"]["max_abs_diff"] > 1e-4  # inexact by design
    md = (tmp_path / "tp.md").read_text()
    assert "### TP step (issue 18, TP 2, dp=1)" in md and md.count("(bound ") == 3


def test_step_bench_tp_dp_rows_well_formed(tmp_path):
    """``--tp 2 --world 4`` (issue 18 at (dp=2, tp=2)) on a tiny Decoder: the five TP rows run on the
    ("dp_shard", "tp") mesh, match the redundant baseline (stock FSDP2 + TP, every matrix
    all-gathered over the 4 ranks), which matches DDP + Muon (an independent reference: no TP, no
    FSDP); the matrixfsdp rows make two all-to-alls per micro-group of their owner row in the step
    and nothing else; the report states the targets at dp=2."""
    out = tmp_path / "tpdp"
    names = ["tp_redundant", "tp_microgroups", "tp_sequential", "tp_unfused", "tp_shard_local", "tp_unfused_lpt",
             "ddp_muon"]
    _step_bench("--tp", "2", "--world", "4", "--impls", ",".join(names), "--repeats", "1",
                "--warmup", "2", "--steps", "1", "--parity-steps", "2", "--retries", "0", "--max-foreign", "1.0",
                "--quiet-wait", "0", "--hidden", "64", "--intermediate", "128", "--layers", "1", "--vocab", "384",
                "--seq", "8", "--global-batch", "4", "--out", str(out))
    lines = [json.loads(line) for line in (tmp_path / "tpdp.jsonl").read_text().splitlines()]
    meta, rows = lines[0]["meta"], {r["impl"]: r for r in lines[1:]}
    assert meta["tp"] == 2 and meta["dp"] == 2 and meta["world"] == 4
    assert meta["mesh_dim_names"] == ["dp_shard", "tp"]
    assert list(rows) == names and all(r["status"] == "ok" for r in rows.values()), rows
    n_mats = 7  # q, k, v, o, gate, up, down of the one layer

    def step_ops(r, rank):
        return r["comm_per_rank"][rank]["step"]["ops"]

    for rank in range(4):
        assert set(step_ops(rows["tp_redundant"], rank)) == {"all_gather_single"}
        assert step_ops(rows["tp_redundant"], rank)["all_gather_single"][0] == n_mats
        assert rows["tp_shard_local"]["comm_per_rank"][rank]["step"]["calls"] == 0
    for name in ("tp_microgroups", "tp_sequential", "tp_unfused", "tp_unfused_lpt"):
        r = rows[name]
        per_row = r["micro_groups_per_row"]
        assert len(per_row) == 2 and sum(per_row) == r["micro_groups"]
        for rank in range(4):  # only the owners' TP rows communicate: 2 all-to-alls per micro-group
            ops = step_ops(r, rank)
            assert set(ops) <= {"all_to_all_single"}, ops
            assert ops.get("all_to_all_single", [0])[0] == 2 * per_row[rank // 2], (name, rank, ops)
        assert r["parity"]["max_abs_diff"] <= 1e-5, r["parity"]
        assert r["ratios"]["step_s"]["tp_redundant"] > 0
    assert rows["tp_unfused"]["micro_groups"] == rows["tp_unfused_lpt"]["micro_groups"] == n_mats
    assert rows["tp_microgroups"]["micro_groups"] == rows["tp_sequential"]["micro_groups"] < n_mats
    # one-matrix groups (tp_c_max=1) rotate over the hosts (the planner's tie-break), so the LPT
    # re-assignment balances no better
    assert rows["tp_unfused"]["step_balance"] <= rows["tp_unfused_lpt"]["step_balance"] * 1.01
    assert rows["ddp_muon"]["parity"]["max_abs_diff_muon_matrices"] <= 1e-5, rows["ddp_muon"]["parity"]
    assert rows["ddp_muon"]["parity"]["max_abs_diff"] <= 1e-4, rows["ddp_muon"]["parity"]
    assert rows["tp_shard_local"]["parity"]["max_abs_diff"] > 1e-4  # inexact by design
    md = (tmp_path / "tpdp.md").read_text()
    assert "### TP step (issue 18, TP 2, dp=2)" in md and md.count("(bound ") == 4  # + the supplementary one
    assert "(\"dp_shard\", \"tp\")" in md and "per dp row" in md


def test_step_bench_tp_world_must_be_multiple(capsys):
    """``--tp T --world W`` needs W = dp * T (checked before any rank starts)."""
    step_bench = _import_bench("step_bench")
    with pytest.raises(SystemExit) as e:
        step_bench.parse_args(["--tp", "2", "--world", "3"])
    assert e.value.code == 2 and "dp * T" in capsys.readouterr().err
    args = step_bench.parse_args(["--tp", "2", "--world", "4"])
    assert (args.tp, args.world, args.reference, args.parity_ref) == (2, 4, "tp_redundant", "tp_redundant")
    assert step_bench._impl_list(args) == [*step_bench.TP_DEFAULT_IMPLS, "tp_unfused_lpt"]
    assert step_bench._impl_list(step_bench.parse_args(["--tp", "2"])) == list(step_bench.TP_DEFAULT_IMPLS)  # dp=1


def test_step_bench_moe_rows_run_and_match_ddp(tmp_path):
    """step_bench --model moe (issue 26) on a tiny MoE: every row runs and matches moe_ddp (each
    expert matrix a 2-D parameter), moe_owners makes no collective in its step and has its
    per-rank alone times, and the report states the goals."""
    out = tmp_path / "moe"
    _step_bench("--world", "2", "--model", "moe", "--impls",
                "moe_ddp,moe_owners,moe_distmuon,moe_gather_muon,moe_tt_distmuon", "--repeats", "1", "--warmup", "2",
                "--steps", "1", "--parity-steps", "2", "--retries", "0", "--max-foreign", "1.0", "--quiet-wait", "0",
                "--alone-reps", "1", "--hidden", "32", "--moe-ffn", "24", "--experts", "5", "--layers", "2",
                "--vocab", "128", "--seq", "16", "--out", str(out))
    rows = {r["impl"]: r for r in map(json.loads, (tmp_path / "moe.jsonl").read_text().splitlines()) if "impl" in r}
    assert set(rows) == {"moe_ddp", "moe_owners", "moe_distmuon", "moe_gather_muon", "moe_tt_distmuon"}
    assert all(r["status"] == "ok" for r in rows.values()), {n: r.get("reason") for n, r in rows.items()}
    for name, r in rows.items():
        assert r["parity"]["max_abs_diff_muon_matrices"] <= 1e-6, (name, r["parity"])
        assert r["parity"]["nan_count"] == 0, name
    assert all(c["step"]["calls"] == 0 for c in rows["moe_owners"]["comm_per_rank"])
    assert len(rows["moe_owners"]["alone_step_s_per_rank"]) == 2
    md = (tmp_path / "moe.md").read_text()
    assert "## MoE rows (issue 26)" in md and "step <= 1.10x its balance limit" in md
    assert "total (fwd+bwd+step) below every other row's" in md


def test_step_bench_moe_refuses_decoder_rows(capsys):
    step_bench = _import_bench("step_bench")
    assert step_bench._impl_list(step_bench.parse_args(["--model", "moe"])) == list(step_bench.MOE_DEFAULT_IMPLS)
    with pytest.raises(SystemExit, match="need --model moe"):
        step_bench._impl_list(step_bench.parse_args(["--impls", "moe_owners"]))
    with pytest.raises(SystemExit, match="train the other model"):
        step_bench._impl_list(step_bench.parse_args(["--model", "moe", "--impls", "ddp_muon"]))


def test_expert_ns_bench_rows_and_parity(tmp_path):
    import torch

    out = tmp_path / "ens"
    threads = torch.get_num_threads()
    try:  # in this process: the one state it sets process-wide, torch's thread count, is restored
        _main("expert_ns_bench.py", "--experts", "3", "--dims", "24,16", "--reps", "1", "--warmup", "1",
              "--quiet-wait", "0", "--retries", "0", "--out", str(out))
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "ens.jsonl").read_text().splitlines()][1:]
    assert [(r["stack"], r["ns_dtype"]) for r in rows] == [
        (s, d) for s in ("w1", "w2", "gate_up_proj") for d in ("float32", "bfloat16")]
    assert [r["matrices"] for r in rows] == [3, 3, 3, 3, 6, 6]
    assert all(r["batched_ms"] > 0 and r["loop_ms"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-3 for r in rows), rows
    md = (tmp_path / "ens.md").read_text()
    assert md.startswith(f"<!-- produced by: python benchmarks/expert_ns_bench.py --experts 3 --dims 24,16")
    assert "batched >= 1.5x the per-expert loop" in md
