"""``python -m matrixfsdp.dryrun`` run in the test's own process, for tests that check what a dry
run reports rather than how the command starts.

A command pays a torch import (~3.5 s on a 2-core box) and then one more per sampled rank, which
``dry_run`` runs in a spawned process of its own. Here ``main(argv)`` runs in the test's process
and each sampled rank still gets a fresh process, forked from the test harness's forkserver
(torch and matrixfsdp imported, nothing run): the rank's code and its isolation are the
command's, without the imports. tests/dryrun/test_dryrun.py's
``test_progress_per_sampled_rank_and_no_profiler_noise`` runs the real command (spawned ranks).
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from types import SimpleNamespace
from typing import Callable

import pytest
from _harness import forkserver_context

__all__ = ["in_process_cli", "in_process_subprocess"]


def in_process_cli(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[int, str, str]]:
    """``cli(*argv)`` -> ``(exit status, stdout, stderr)`` of ``python -m matrixfsdp.dryrun *argv``,
    its ranks forked from the harness's forkserver (for the rest of the test)."""
    import matrixfsdp.dryrun as dryrun_pkg
    from matrixfsdp.dryrun.__main__ import main

    monkeypatch.setattr(dryrun_pkg, "multiprocessing", SimpleNamespace(get_context=lambda _: forkserver_context()))

    def cli(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(argv))
        return status, out.getvalue(), err.getvalue()

    return cli


def in_process_subprocess(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A stand-in for the ``subprocess`` module of code that runs ``[python, "-m",
    "matrixfsdp.dryrun", ...]`` commands: its ``run`` runs them with :func:`in_process_cli`."""
    cli = in_process_cli(monkeypatch)

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        if list(cmd[1:3]) != ["-m", "matrixfsdp.dryrun"]:
            raise ValueError(f"in_process_subprocess: only runs python -m matrixfsdp.dryrun, got {cmd!r}")
        status, out, err = cli(*cmd[3:])
        return subprocess.CompletedProcess(cmd, status, out, err)

    return SimpleNamespace(run=run)
