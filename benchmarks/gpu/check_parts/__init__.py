"""The parts of the prepared one-GPU check, ``benchmarks/gpu/check.py`` (issues 19 and 29): one
module per concern, each exporting its ``part_<name>(ctx) -> dict`` worker, which ``check.py``'s
driver runs in a subprocess (or inline) and whose ``"ok"`` and ``"key"`` fill the summary table.

Modules: ``core`` (what the parts share: the W=1 process group, the tiny decoder sharded with
``fully_shard``, its loss and tokens, and :class:`~check_parts.core.Ctx`, the device, backend,
mode and row writer a part runs with), ``race`` (1, stream ordering), ``smoke`` (2, the APIs that
touch collectives), ``sync_debug`` (3, host syncs), ``kernels`` (4, Newton-Schulz throughput),
``memory`` (5, peak against FSDP2) and ``graphs`` (6, the ``compile`` part: ``torch.compile`` and
CUDA graphs of the optimizer step).

The package is imported as ``check_parts`` with ``benchmarks/gpu`` on ``sys.path`` (the script's
own folder when run as ``python benchmarks/gpu/check.py``; ``check.py`` adds it when imported).
Each part imports ``matrixfsdp`` inside its function: ``check.py --inline`` puts this tree's
``src`` on ``sys.path`` only after the parts are imported.
"""
