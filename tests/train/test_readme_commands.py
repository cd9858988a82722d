"""The README's training commands, run as written and in the README's order from a clean folder
(the issue: ``--model tiny-moe`` after the main job exited 2, ``runs/train`` already holding a run).

Each is run with smoke-size options appended (a short corpus, no sample, batches of 4 x 32 bytes)
and its step counts scaled by 1/100, rounded up (the default 200 -> 2, ``--steps 250`` -> 3), so
the sequence keeps its meaning (the resume trains on) at a few seconds per command; the default
output folders are the ones a user gets. The first command is the README's main job
(tests/test_readme.py): its two runs' summaries and plot are checked here. The full-size runs are measured and committed under benchmarks/results/train/.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["--max-corpus-bytes", "60000", "--sample-bytes", "0", "--threads", "1", "--batch", "4", "--seq-len", "32"]


def readme_train_commands() -> list[list[str]]:
    """``python -m matrixfsdp.train ...`` of the README's "The two commands" section, in order:
    the main job's code block, then every inline command."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    spans = re.findall(r"```bash\n(.+?)\n```|`(python -m matrixfsdp\.train[^`]*)`", section, flags=re.S)
    cmds = []
    for block, inline in spans:
        cmd = inline or block.split("&&")[-1].strip()
        if cmd.startswith("python -m matrixfsdp.train") and "--help" not in cmd:
            cmds.append(cmd.split()[1:])  # without "python"
    return cmds


def scaled(argv: list[str]) -> list[str]:
    argv = list(argv)
    if "--steps" in argv:
        i = argv.index("--steps") + 1
        argv[i] = str(math.ceil(int(argv[i]) / 100))
    else:
        argv += ["--steps", "2"]
    return argv + SMOKE


def test_readme_commands_run_in_order_from_a_clean_folder(tmp_path):
    cmds = readme_train_commands()
    assert [c[2:] for c in cmds] == [[], ["--resume", "--steps", "250"], ["--model", "tiny-moe"]], cmds
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    for i, cmd in enumerate(cmds):
        res = subprocess.run([sys.executable, *scaled(cmd)], capture_output=True, text=True, timeout=300,
                             env=env, cwd=tmp_path)
        assert res.returncode == 0, (cmd, res.stdout + res.stderr)
        if i == 0:  # the README's main job (tests/test_readme.py checks it is this command): both runs
            assert "matrixfsdp-muon: 2 steps at W=2" in res.stdout and "fsdp2-adamw: 2 steps at W=2" in res.stdout
            assert (tmp_path / "runs" / "train" / "loss.png").exists()
    steps = {}
    for folder in ("runs/train", "runs/train-tiny-moe"):
        recs = [json.loads(line) for line in (tmp_path / folder / "matrixfsdp-muon.jsonl").read_text().splitlines()]
        steps[folder] = recs[-1]["step"] if recs[-1].get("final") else None
    assert steps == {"runs/train": 3, "runs/train-tiny-moe": 2}  # the resume trained on; the MoE ran
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["train", "train-tiny-moe"]
