"""Rerun the default main job (matrixfsdp + Muon, 2 ranks, 200 steps) from this tree and compare
its 200 per-step losses bitwise with ``main_job_losses.json`` (computed at 25ffc19, before the
engine's one ``Reducer``). About 2 minutes on 2 cores; not part of the test suite.

    python tests/golden/check_main_job.py      # exit 0: identical; 1: the first differing steps
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    golden = json.load(open(os.path.join(HERE, "main_job_losses.json")))["losses"]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "matrixfsdp.train", "--no-compare", "--no-progress", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        got = [[r["step"], r["loss"]] for r in map(json.loads, open(os.path.join(out, "matrixfsdp-muon.jsonl")))
               if "loss" in r and "step" in r]
    diff = [(g, w) for g, w in zip(got, golden) if g != w]
    if len(got) != len(golden) or diff:
        print(f"{len(got)} losses vs {len(golden)}; first differences (got, golden): {diff[:5]}")
        return 1
    print(f"the {len(got)} losses are bitwise those of 25ffc19")
    return 0


if __name__ == "__main__":
    sys.exit(main())
