"""Plot the ZeRO-1/2 rows of step_bench results: optimizer step against its balance limit, and
fwd+bwd against DDP, one panel pair per results file.

    python benchmarks/plot_zero.py benchmarks/results/zero/step_cpu_w4_zero.jsonl \
        benchmarks/results/zero/step_netns1gbit_w4_zero.jsonl --out benchmarks/results/zero/step_w4_zero.png

Reads only the files given (each written by ``step_bench.py --out``); medians over clean repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REFERENCE = "ddp_muon"


def summarize(path: Path, max_foreign: float = 0.15) -> tuple[str, int, dict[str, dict[str, float]]]:
    """``(label, W, {impl: {step, limit, fb_ratio, balance}})`` from one step_bench JSONL file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    meta = next(r["meta"] for r in rows if "meta" in r)
    ok = [r for r in rows if r.get("status") == "ok"]
    clean = [r for r in ok if (r.get("foreign_cpu_share") or 0) <= max_foreign] or ok

    def med(impl: str, key: str) -> float:
        return statistics.median(r[key] for r in clean if r["impl"] == impl)

    W = meta["world"]
    ref_step, ref_fb = med(REFERENCE, "step_s"), med(REFERENCE, "fb_s")
    out: dict[str, dict[str, float]] = {}
    for impl in dict.fromkeys(r["impl"] for r in clean if "step_balance" in r):
        b = next(r["step_balance"] for r in clean if r["impl"] == impl)
        out[impl] = {"step": med(impl, "step_s"), "limit": ref_step * b / W, "balance": b,
                     "fb_ratio": med(impl, "fb_s") / ref_fb}
    label = path.stem.removeprefix("step_").replace("_w4_zero", "").replace("netns", "")
    return label or path.stem, W, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="step_bench JSONL files")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [summarize(p) for p in args.results]
    fig, axes = plt.subplots(len(data), 2, figsize=(12, 3.6 * len(data)), squeeze=False)
    for (label, W, d), (ax1, ax2) in zip(data, axes):
        names = list(d)
        x = range(len(names))
        ax1.bar([i - 0.2 for i in x], [d[n]["step"] for n in names], 0.4, label="optimizer step (measured)")
        ax1.bar([i + 0.2 for i in x], [d[n]["limit"] for n in names], 0.4, label=f"balance limit ({REFERENCE} step x balance / W)")
        ax1.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        ax1.set_ylabel("seconds")
        ax1.set_title(f"{label}, W={W}: optimizer step")
        ax1.legend(fontsize=7)
        ax2.bar(list(x), [d[n]["fb_ratio"] for n in names], 0.5, color="tab:green")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.axhline(1.05, color="tab:red", lw=0.8, ls="--", label="1.05x target")
        ax2.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        ax2.set_ylabel(f"fwd+bwd / {REFERENCE}")
        ax2.set_title(f"{label}, W={W}: forward + backward")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    for label, W, d in data:
        for n, v in d.items():
            print(json.dumps({"results": label, "world": W, "impl": n, **{k: round(x, 4) for k, x in v.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
