"""``python -m matrixfsdp.train`` run from the test's own process, for tests that check what a run
writes, prints and refuses rather than how the command starts.

A command pays a torch + matrixfsdp import (~4.6 s CPU on a 2-core box) in its parent before it
forks its ranks, which then run a few tiny steps. Here the command's ``main(argv)`` runs in the
test's process and its ranks are forked from the test harness's forkserver (torch and matrixfsdp
imported, nothing run) instead of from that parent: the same rank code (``cli._spawned``), a fresh
process per rank, each rank's stdout and stderr written to a file and returned as the command's.
The command as a user types it stays pinned where a test runs it for real
(tests/train/test_job.py's reference run, tests/train/test_readme_commands.py, tests/test_readme.py).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import subprocess
import tempfile

import pytest
from _harness import forkserver_context

__all__ = ["TIMEOUT_S", "train_in_process"]

#: a rank still running after this long dumps its stacks to its stderr and exits 1 (as the
#: subprocess form's timeout, it turns a hang into a failure)
TIMEOUT_S = 300


def _rank(rank: int, cfg, world: int, store_path: str, out_dir: str) -> None:
    """A rank's entry: stdout and stderr to files, then the command's own rank body."""
    import faulthandler

    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    from matrixfsdp.train.cli import _spawned

    _spawned(rank, cfg, world, store_path)  # ends the process (os._exit) with the rank's status


def train_in_process(*argv: str) -> subprocess.CompletedProcess:
    """``python -m matrixfsdp.train *argv`` as described above: its exit status, and its stdout and
    stderr (the command's own, then each rank's in rank order)."""
    from matrixfsdp.train import cli

    forkserver_context()  # the harness's server and preloads, before torch's start_processes asks for one
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory(prefix="matrixfsdp-train-test-") as d, pytest.MonkeyPatch.context() as m:
        m.setattr(cli, "_start_method", lambda device="cpu": "forkserver")
        m.setattr(cli, "_spawned", functools.partial(_rank, out_dir=d))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(list(argv))
        for name, buf in (("out", out), ("err", err)):
            for rank in sorted(int(p.split(".")[0]) for p in os.listdir(d) if p.endswith("." + name)):
                with open(os.path.join(d, f"{rank}.{name}")) as f:
                    buf.write(f.read())
    return subprocess.CompletedProcess(["python", "-m", "matrixfsdp.train", *argv], status, out.getvalue(),
                                       err.getvalue())
