"""benchmarks/canzona_fig3.py (Canzona Fig. 3c reproduction) on the tiny preset: its core function and
its CLI outputs, so the script cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
cf = pytest.importorskip("canzona_fig3")


@pytest.mark.parametrize("config,tp", [("canzona", 2), ("canzona-sharded", 2), ("ours", None)])
def test_fig3_rows_tiny(config, tp):
    rows = cf.fig3_rows("tiny", 4, config=config, tp=tp, bucket_numel=20_000)
    assert [(r["policy"], r["alpha"]) for r in rows] == (
        [("naive_static", None)] + [("alpha_balanced", a) for a in cf.ALPHAS] + [("balanced", None)])
    for r in rows:
        assert r["flops_imbalance"] >= 1.0 and r["memory_imbalance"] >= 1.0 and 0 <= r["idle_ranks"] < 4
    naive, a1 = rows[0], rows[len(cf.ALPHAS)]
    assert a1["alpha"] == 1.0 and a1["flops_imbalance"] <= naive["flops_imbalance"]
    assert naive["num_buckets"] >= 1 and rows[-1]["num_buckets"] is None


def test_megatron_layout_is_one_tp_rank_in_backward_order():
    model, block = cf.build("tiny", "megatron", 2)  # tiny: 4 heads, 2 KV heads, 160 intermediate, vocab 512
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "output_layer.weight" and names[-1] == "embedding.weight"
    shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
    assert shapes["embedding.weight"] == (256, 96)
    assert shapes["layers.0.linear_qkv.weight"] == ((2 + 2 * 1) * 24, 96)
    assert shapes["layers.0.linear_fc1.weight"] == (160, 96) and shapes["layers.0.linear_fc2.weight"] == (96, 80)
    layer_names = [n.split(".")[2] for n in names if n.startswith("layers.0.")]
    assert layer_names == ["linear_fc2", "linear_fc1", "pre_mlp_layernorm", "linear_proj", "k_layernorm",
                           "q_layernorm", "linear_qkv", "input_layernorm"]


def test_cli_writes_jsonl_md_png(tmp_path, capsys):
    out = tmp_path / "fig3"
    args = ["--model", "tiny", "--world", "4", "--tp", "2", "--bucket", "20000", "--match-bucket", "60000",
            "--buckets", "20000", "100000", "--worlds", "2", "--models", "tiny", "--out", str(out)]
    assert cf.main(args) == 0  # in process: the same code path as the command line, without a second torch import
    stdout = capsys.readouterr().out
    md = (tmp_path / "fig3.md").read_text()
    assert md.splitlines()[0] == "<!-- produced by: python benchmarks/canzona_fig3.py " + " ".join(args) + " -->"
    assert "torch " in md.splitlines()[1]
    rows = [json.loads(line) for line in (tmp_path / "fig3.jsonl").read_text().splitlines()]
    assert {r["section"] for r in rows} == {"fig3", "ladder", "bucket", "world", "models"}
    assert (tmp_path / "fig3.png").stat().st_size > 10_000
    assert not any(line.startswith("{") for line in stdout.splitlines())  # --out: only the markdown
    assert "| canzona-sharded | 0.06M | naive_static |" in stdout
