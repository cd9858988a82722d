"""The README's two commands are the ones CI and users run: keep them honest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_names_exactly_two_commands_and_ci_runs_the_test_one():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    main, test = cmds
    assert "python -m matrixfsdp.plan" in main and "-c constraints.txt" in main
    assert "pytest" in test and "-c constraints.txt" in test
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines(), "'.ci/run' must run the README's test command verbatim"


def test_readme_main_job_runs():
    main = _commands()[0]
    cli = main.split("&&", 1)[1].strip().split()
    assert cli[:3] == ["python", "-m", "matrixfsdp.plan"]
    out = subprocess.run([sys.executable, *cli[1:]], capture_output=True, text=True, timeout=300, check=True)
    assert "OwnerPlan  world_size=32" in out.stdout
    assert "worst gamma_B / bound: 1.000" in out.stdout
