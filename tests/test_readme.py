"""The README's two commands are the ones CI and users run: keep them honest."""

from __future__ import annotations

import re
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
    assert "python -m matrixfsdp.train" in main and "-c constraints.txt" in main
    assert "pytest" in test and "-c constraints.txt" in test
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines(), "'.ci/run' must run the README's test command verbatim"
    # the other tested releases run the torch-internals subset ([Note: the torch-internals
    # subset]): the GPU image's 2.11, and the newest with the machine's pip cap lifted (DEVELOPERS.md)
    subset = test + " -m torch_internals"
    gpu_image = subset.replace("constraints.txt", "constraints-torch2.11.txt")
    newest = "PIP_CONSTRAINT=/dev/null " + subset.replace("constraints.txt", "constraints-torch2.15.txt")
    assert gpu_image in ci.splitlines(), gpu_image
    assert newest in ci.splitlines(), newest
    assert "torch==2.11.0" in (ROOT / "constraints-torch2.11.txt").read_text().splitlines()
    assert "torch==2.15.0" in (ROOT / "constraints-torch2.15.txt").read_text().splitlines()


def test_readme_main_job_is_the_train_command_and_ci_installs_its_extra():
    """The README's main job: an install of an extra CI's [test] covers, then ``python -m
    matrixfsdp.train``. tests/train/test_readme_commands.py runs it exactly as written (its first
    command), with smoke-size options appended (the full ~2-minute run is measured and committed
    in benchmarks/results/train/default/)."""
    main = _commands()[0]
    install, cli = (part.strip() for part in main.split("&&", 1))
    extras = _extras()
    wanted = install.split("-e", 1)[1].strip().strip('"').lstrip(".").strip("[]")  # "train"
    assert set(extras[wanted]) <= set(extras["test"]), "CI installs [test]: it must cover the main job's extra"
    assert cli.split() == ["python", "-m", "matrixfsdp.train"], cli


def _extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
