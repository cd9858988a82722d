"""``python -m matrixfsdp.plan``: presets, Hugging Face configs, JSON output, bad input."""

from __future__ import annotations

import json

import pytest

from matrixfsdp import OwnerPlan
from matrixfsdp.plan import main
import torch

from matrixfsdp.models import PRESETS, Decoder, DecoderLayer
from matrixfsdp.planner.owners import plan_owners

QWEN3_0_6B_HF = {  # the published Qwen/Qwen3-0.6B config.json, shape fields
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
}


def test_hf_config_plans_like_the_preset(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_0_6B_HF))
    assert main(["--hf-config", str(cfg), "--world", "8", "--json"]) == 0
    from_hf = OwnerPlan.from_json(capsys.readouterr().out)
    assert main(["--model", "qwen3-0.6b", "--world", "8", "--json"]) == 0
    from_preset = OwnerPlan.from_json(capsys.readouterr().out)
    assert from_hf == from_preset
    assert from_hf.world_size == 8 and len(from_hf.blocks) == 28


def test_llama_style_config_without_head_dim(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, "hidden_size": 512,
                               "intermediate_size": 1376, "num_hidden_layers": 2, "num_attention_heads": 8}))
    assert main(["--hf-config", str(cfg), "--world", "3", "--no-ranks", "--blocks"]) == 0
    out = capsys.readouterr().out
    assert "OwnerPlan  world_size=3" in out and "model.layers.1" in out
    assert "q_norm" not in out


def test_report_lists_ranks_bounds_and_gamma(capsys):
    assert main(["--model", "qwen3-1.7b", "--world", "16", "--ranks", "--blocks"]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "gamma_B" in out
    assert sum(1 for line in out.splitlines() if line.strip().split(" ")[0].isdigit()) >= 16


@pytest.mark.parametrize("argv, msg", [
    (["--world", "0"], "--world must be >= 1, got 0"),
    (["--hf-config", "/nonexistent/config.json", "--world", "2"], "config_from_hf: cannot read"),
])
def test_bad_input(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_incomplete_hf_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"vocab_size": 10}))
    assert main(["--hf-config", str(cfg), "--world", "2"]) == 2
    assert "lacks ['hidden_size'" in capsys.readouterr().err


def test_qwen3_32b_on_32_ranks_reaches_every_bound(capsys):
    """The planner example of docs/planner.md (it was the README's first command)."""
    assert main(["--model", "qwen3-32b", "--world", "32"]) == 0
    out = capsys.readouterr().out
    assert "OwnerPlan  world_size=32" in out
    assert "worst gamma_B / bound: 1.000" in out


def test_help_names_the_default_model_and_every_option(capsys):
    from matrixfsdp.plan import build_parser

    parser = build_parser()
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    assert "plans qwen3-32b" in text and "(default: qwen3-32b)" in text
    assert "qwen3-4b,qwen3-8b,qwen3-14b" in text  # natural order


def test_report_sorted_naturally_explains_gamma_and_fits_120_columns(capsys):
    assert main(["--model", "qwen3-0.6b", "--world", "64", "--ranks", "--blocks"]) == 0
    out = capsys.readouterr().out
    blocks = [line.split()[0] for line in out.splitlines() if line.startswith("  model.layers.")]
    assert blocks[:3] == ["model.layers.0", "model.layers.1", "model.layers.2"] and len(blocks) == 28
    assert "gamma_B: a block's most loaded owner's bytes / (block bytes / W)" in out
    assert max(len(line) for line in out.splitlines()) <= 120


def test_sizes_in_the_config_dtype(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_0_6B_HF, "torch_dtype": "float32"}))
    assert main(["--hf-config", str(tmp_path), "--world", "8", "--no-ranks", "--no-blocks"]) == 0  # a folder
    out32 = capsys.readouterr().out
    assert "in float32" in out32 and "(2.22 GiB)" in out32
    assert main(["--model", "qwen3-0.6b", "--world", "8", "--no-ranks", "--no-blocks"]) == 0
    assert "in bfloat16" in (out := capsys.readouterr().out) and "(1.11 GiB)" in out


@pytest.mark.parametrize("argv, msg", [
    (["--world", "8", "--policy", "alpha_balanced", "--alpha", "-3"], "error: plan_owners: alpha must be"),
    (["--world", "8", "--policy", "alpha_balanced", "--bucket-numel", "0"], "error: plan_owners: bucket_numel"),
])
def test_bad_values_are_error_lines(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and "Traceback" not in err


def test_closed_pipe_exits_quietly():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(f"{sys.executable} -m matrixfsdp.plan --world 32 | head -1", shell=True,
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.stdout.startswith("# qwen3-32b") and res.stderr == "", res.stderr


def test_plan_cli_hsdp_reports_replicas(capsys):
    """``--replicas R`` plans an (R, world/R) HSDP mesh and reports the replica assignment."""
    assert main(["--model", "qwen3-0.6b", "--world", "16", "--replicas", "2", "--replica-step", "split",
                 "--no-ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    assert "replicas=2 x world_size=8  replica_step=split (split)" in out
    assert "308 of 308 owned parameters split" in out and "r0: " in out and "r1: " in out
    assert main(["--model", "qwen3-0.6b", "--world", "16", "--replicas", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["replicas"] == 2 and plan["world_size"] == 8
    assert main(["--world", "6", "--replicas", "4"]) == 2
    assert "error: --replicas must be >= 1 and divide --world, got --replicas 4 with --world 6" in capsys.readouterr().err


def test_tp_report_lists_micro_groups(capsys):
    assert main(["--model", "qwen3-0.6b", "--world", "2", "--tp", "4", "--no-ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: tp=4" in out and "sum of makespans" in out and "sum of bounds" in out
    assert "group  members      makespan        bound   ratio   buffer" in out
    assert "owner  groups  sum makespan    sum bound   ratio" in out  # one row per owner at --world 2
    rows = [line.split() for line in out.splitlines() if line.strip().endswith(("MiB", "KiB", "GiB"))
            and line.split()[0].isdigit()]
    assert rows and [int(r[0]) for r in rows] == list(range(len(rows)))
    assert all(float(r[4]) >= 1.0 for r in rows)  # makespan / bound
    # --tp-c-max shrinks the buffer: more groups; --json carries them
    assert main(["--model", "qwen3-0.6b", "--world", "2", "--tp", "4", "--tp-c-max", str(2**20), "--json"]) == 0
    plan = OwnerPlan.from_json(capsys.readouterr().out)
    assert plan.tp == 4 and len(plan.micro_groups) == 2
    assert all(g.buffer_bytes <= 2**20 or len(g.members) == 1 for gs in plan.micro_groups for g in gs)
    assert sum(len(gs) for gs in plan.micro_groups) > len(rows)
    assert main(["--model", "qwen3-0.6b", "--world", "2", "--tp", "0"]) == 2
    assert "plan_owners: tp must be an int >= 1, got tp=0" in capsys.readouterr().err


def test_moe_preset_reports_experts_against_the_baselines(capsys):
    assert main(["--model", "qwen3-30b-a3b", "--world", "8", "--ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# qwen3-30b-a3b: 30.53B parameters (3.35B active) in bfloat16, planned in ")
    assert "experts: 96 stacks, 18432 expert matrices, " in out
    assert "this plan (balanced)" in out and "round-robin (expert e on rank e mod W)" in out
    assert "chunked (torch.chunk homes, as EP)" in out
    assert "  rank  owned  experts   param bytes   +state bytes        cost  owns" in out
    lines = out.splitlines()
    head = lines.index("  rank  owned  experts   param bytes   +state bytes        cost  owns")
    rows = [line.split() for line in lines[head + 1:head + 9]]
    assert [int(r[0]) for r in rows] == list(range(8)) and sum(int(r[2]) for r in rows) == 18432
    assert max(len(line) for line in out.splitlines()) <= 120


def test_deepseek_v3_at_512_ranks_and_hsdp(capsys):
    """At W > E both baselines leave W - E ranks without experts: expert imbalance W / E = 2 at
    W = 512 (the planner at W = 1024, W / E = 4, is tests/planner/test_expert_baselines.py's; the
    CLI's report at 512 ranks costs half as much)."""
    assert main(["--model", "deepseek-v3", "--world", "512", "--no-ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    assert "(37.55B active)" in out and "experts: 174 stacks, 44544 expert matrices" in out  # 58 MoE layers x 3
    rr = next(line for line in out.splitlines() if "round-robin" in line).split()
    assert rr[-4] == "2.000"  # expert matrices max/avg
    assert main(["--model", "qwen3-30b-a3b", "--world", "64", "--replicas", "8", "--no-ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    assert "replicas=8 x world_size=8" in out and "experts: 96 stacks" in out


def test_tiny_moe_json_carries_the_expert_counts(capsys):
    assert main(["--model", "tiny-moe", "--world", "3", "--json"]) == 0
    plan = OwnerPlan.from_json(capsys.readouterr().out)
    stacks = [p for p in plan.params if p.placement == "experts"]
    assert len(stacks) == 8 and all(sum(p.experts) == 8 and len(p.experts) == 3 for p in stacks)
    assert {p.fqn.rpartition(".")[2]: p.splits for p in stacks} == {"gate_up_proj": 2, "down_proj": 1}
    from matrixfsdp.plan import build_parser

    text = build_parser().format_help()
    assert "qwen3-30b-a3b" in text and "deepseek-v3" in text and "tiny-moe-mla" in text


def test_a_poor_plan_warns_and_names_the_replicas_that_fix_it(capsys):
    """plan/bound 1.000 at W=1024 hid 736 idle ranks and a rank at ~6x an even share: the report
    says so, and the CLI names the fewest HSDP replicas whose plan has no warning."""
    from matrixfsdp.planner.report import plan_warnings

    assert main(["--model", "qwen3-8b", "--world", "1024", "--no-ranks", "--no-blocks", "--placement", "owned"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the report wraps at 120 columns
    assert "736 of 1024 shard ranks own or host no tensor" in flat
    assert ("the most loaded rank holds 6.18x the parameter + gradient + optimizer-state bytes of FSDP2's most "
            "loaded rank on this mesh") in flat
    assert "267.1x" in flat and "placement='auto' would host the matrices behind it" in flat
    assert "# suggestion: --replicas 16 (owners planned among 64 ranks" in out
    # the default (auto) hosts every matrix, Muon's momentum on the rows: FSDP2's memory (no memory
    # warning), the step's work on 252 of 1024 ranks (the idle warning, and fewer replicas suffice)
    assert main(["--model", "qwen3-8b", "--world", "1024", "--no-ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "params+grads+state 1.002 (memory; FSDP2 on this mesh: 1.001)" in flat and "the most loaded rank holds" not in flat
    assert "hosted: 252 matrices (12.94 GiB) stored evenly" in flat and "the hosts keep none" in flat
    assert "# suggestion: --replicas 4 (owners planned among 256 ranks" in out
    assert max(len(line) for line in out.splitlines()) <= 120
    # the suggested HSDP plan, and a flat W=64 one, have nothing to warn about
    assert main(["--model", "qwen3-8b", "--world", "1024", "--replicas", "16", "--no-ranks", "--no-blocks"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out and "suggestion" not in out
    with torch.device("meta"):
        model = Decoder(PRESETS["qwen3-8b"]).to(torch.bfloat16)
    assert plan_warnings(plan_owners(model, 64, block_types=(DecoderLayer,))) == []


def test_summary_is_the_default_and_the_tables_are_opt_in(capsys):
    """At large W the per-rank and per-block tables ran to thousands of lines, the warning at the
    top and the suggestion at the bottom: now the tables are opt-in (--ranks, --blocks; the old
    --no-ranks / --no-blocks still parse) and the warnings end the report, next to the suggestion."""
    assert main(["--model", "qwen3-0.6b", "--world", "512"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 40 and "  rank  owned" not in out and "gamma_B   bound   ratio" not in out
    assert "# left out: --ranks, --blocks" in out
    warn = next(i for i, line in enumerate(lines) if "WARNING" in line)
    sugg = next(i for i, line in enumerate(lines) if line.startswith("# suggestion"))
    assert warn < sugg and all(not line.startswith("  ") or line.startswith("    ") or line.startswith("      ")
                               for line in lines[warn + 1:sugg])  # nothing but the warnings in between
    assert main(["--model", "qwen3-0.6b", "--world", "512", "--no-ranks", "--no-blocks"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == lines[1:]  # the first line times the planner
    assert main(["--model", "qwen3-0.6b", "--world", "8", "--ranks", "--blocks"]) == 0
    out = capsys.readouterr().out
    assert "  rank  owned" in out and "gamma_B   bound   ratio" in out and "left out" not in out


def test_moe_ranks_holding_experts_are_not_idle(capsys):
    """An expert matrix is stepped whole by the rank holding it: tiny-moe at W=32 puts 2-4 on
    every rank (the warning said 10 of 32 ranks step nothing); at W=128, 40 ranks hold nothing.
    The remedy says why placement='auto', the default, hosted nothing."""
    assert main(["--model", "tiny-moe", "--world", "32"]) == 0
    out = capsys.readouterr().out
    assert "2-4 per shard rank" in out and "WARNING" not in out and "suggestion" not in out
    assert main(["--model", "tiny-moe", "--world", "128"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "40 of 128 shard ranks own, host or hold the experts of no tensor" in flat
    assert "placement='auto' (the default) hosted nothing: it hosts matrices only to keep a rank within" in flat
    assert "--placement auto" not in flat
