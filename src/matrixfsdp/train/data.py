"""The main job's data: the Python standard library's own source, byte-tokenized.

Every machine that runs Python has it, so nothing is downloaded and nothing third-party is
committed. The corpus is the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` in
sorted order (about 170 files, ~4.7 MB on CPython 3.11); every 10th file (by sorted index, 9, 19,
...) is held out whole, so held-out text never shares a file with training text. Tokens are bytes
(vocabulary 256).

Batches are a pure function of ``(seed, step)``: global batch ``s`` is ``batch`` windows of
``seq_len + 1`` bytes at offsets drawn from a generator seeded with ``seed * 1_000_003 + s``, and
rank ``r`` of ``W`` takes rows ``r * batch / W ... (r + 1) * batch / W``. The "loader position"
is therefore just the step, a resumed run sees exactly the batches an uninterrupted one does, and
a run at another world size sees the same global batches.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "global_batch", "local_batch", "heldout_windows", "VOCAB_SIZE"]

VOCAB_SIZE = 256
HELDOUT_EVERY = 10


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor    # uint8 [N]
    heldout: torch.Tensor  # uint8 [M]
    files: int
    sha256: str            # of train + heldout bytes, to check that a resumed run reads the same data
    root: str


def load_corpus(root: str | None = None, *, max_bytes: int | None = None) -> Corpus:
    """Read the standard library's top-level sources (or ``root``'s ``*.py``), split train/held-out.

    ``max_bytes`` caps the training text (for quick tests); the held-out text is capped at a
    tenth of it.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(base.glob("*.py"))
    if len(files) < HELDOUT_EVERY:
        raise ValueError(f"matrixfsdp.train: need at least {HELDOUT_EVERY} *.py files in {str(base)!r} "
                         f"for the corpus, found {len(files)}")
    train, held = bytearray(), bytearray()
    for i, f in enumerate(files):
        data = f.read_bytes()
        (held if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else train).extend(data)
    if max_bytes is not None:
        train, held = train[:max_bytes], held[: max(max_bytes // 10, 1)]
    digest = hashlib.sha256(bytes(train) + b"\0" + bytes(held)).hexdigest()
    to_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(train=to_t(train), heldout=to_t(held), files=len(files), sha256=digest, root=str(base))


def _windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    idx = offsets[:, None] + torch.arange(seq_len + 1)[None, :]
    return data[idx].long()


def global_batch(corpus: Corpus, step: int, *, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Global batch ``step``: ``[batch, seq_len + 1]`` int64 byte windows of the training text."""
    n = corpus.train.numel() - seq_len - 1
    if n < 1:
        raise ValueError(f"matrixfsdp.train: the training text ({corpus.train.numel()} bytes) is shorter "
                         f"than one window (seq_len + 1 = {seq_len + 1})")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return _windows(corpus.train, torch.randint(0, n, (batch,), generator=g), seq_len)


def local_batch(corpus: Corpus, step: int, *, batch: int, seq_len: int, seed: int, rank: int,
                world: int) -> torch.Tensor:
    """This rank's rows of global batch ``step`` (``batch // world`` of them)."""
    b = batch // world
    return global_batch(corpus, step, batch=batch, seq_len=seq_len, seed=seed)[rank * b:(rank + 1) * b]


def heldout_windows(corpus: Corpus, *, count: int, seq_len: int) -> torch.Tensor:
    """``count`` evenly spaced, non-random windows of the held-out text (the same in every run)."""
    n = corpus.heldout.numel() - seq_len - 1
    if n < 1:
        raise ValueError(f"matrixfsdp.train: the held-out text ({corpus.heldout.numel()} bytes) is "
                         f"shorter than one window (seq_len + 1 = {seq_len + 1})")
    offsets = torch.linspace(0, n, count).long()
    return _windows(corpus.heldout, offsets, seq_len)
