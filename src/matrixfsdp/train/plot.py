"""The main job's loss plot: train loss (raw, faint, and a running mean) and held-out loss per run."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_log", "plot_losses"]


def read_log(path: Path) -> list[dict]:
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return recs


def plot_losses(out: Path, runs: list[str], png: Path) -> Path:
    """Write ``png`` from ``out/<run>.jsonl`` for each run; returns ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    title = ""
    for run, color in zip(runs, colors):
        recs = read_log(out / f"{run}.jsonl")
        head = next((r for r in recs if r.get("header")), {})
        steps = [r["step"] for r in recs if "loss" in r]
        losses = [r["loss"] for r in recs if "loss" in r]
        if not steps:
            continue
        k = 10
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth, color=color, linewidth=1.8, label=f"{run} train (mean of 10)")
        ev = [(r["step"], r["heldout_loss"]) for r in recs if "heldout_loss" in r and not r.get("final")]
        if ev:
            ax.plot(*zip(*ev), color=color, linestyle="--", marker="o", markersize=4,
                    label=f"{run} held-out")
        cfg = head.get("config", {})
        if cfg and not title:
            title = (f"{cfg.get('model')} decoder ({head.get('model_params', 0) / 1e6:.2f}M params), "
                     f"W={head.get('world_size')}, {cfg.get('batch')}x{cfg.get('seq_len')} bytes/step, "
                     f"Python stdlib source")
    ax.set_xlabel("step (same tokens per step for every run)")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png
