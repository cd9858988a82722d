"""Part 3 of ``benchmarks/gpu/check.py``, ``sync_debug``: host syncs per phase counted with
``torch.cuda.set_sync_debug_mode("warn")`` plus the project's own host read (``FlagRead.resolve``'s
event wait, invisible to torch's sync debug), with declared expectations: Muon with an unused
parameter (one read per backward), Muon with ``set_find_unused_parameters(False)`` (none), Shampoo
and SOAP (none but one ``eigh`` error-flag read per ``torch.linalg.eigh`` call at preconditioner
refreshes). A positive control runs first: one deliberate ``.item()`` must be counted, and an
in-place add not at all; otherwise the part fails."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from .core import Ctx, bf16_mp, device_sync, lm_loss, shard_decoder, tiny_decoder, tokens_for, w1_group


class _CountCalls(torch.overrides.TorchFunctionMode):
    """Counts ``torch.linalg.eigh`` and ``qr`` calls (each checks an error flag on the host)."""

    def __init__(self):
        super().__init__()
        self.calls = {"eigh": 0, "qr": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.linalg.eigh:
            self.calls["eigh"] += 1
        elif func is torch.linalg.qr:
            self.calls["qr"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _flag_waits():
    """Counts ``FlagRead.resolve``'s host waits (its event's ``synchronize``): the project's one
    documented host read, which torch's sync debug mode does not see. Patches the engine's class
    in this check process only, restored on exit."""
    from matrixfsdp.engine import reducer

    box = {"waits": 0, "resolves": 0}
    orig = reducer.FlagRead.resolve

    def resolve(self, *a, **kw):
        box["resolves"] += 1
        if self.host is not None and self.event is not None:
            box["waits"] += 1
        return orig(self, *a, **kw)

    reducer.FlagRead.resolve = resolve
    try:
        yield box
    finally:
        reducer.FlagRead.resolve = orig


def _torch_syncs(fn: Callable[[], Any], cuda: bool) -> int | None:
    """Synchronizing CUDA calls torch's sync debug mode reports during ``fn`` (None on the CPU)."""
    if not cuda:
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def part_sync_debug(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp
    from matrixfsdp.comm.collectives import force_collectives
    from matrixfsdp.engine import reducer

    dev = ctx.dev
    steps = ctx.steps(4, 3, 3)
    cases = (  # name, optimizer, kwargs, model has an unused parameter, find_unused
        ("Muon unused find_unused=True", "Muon", dict(lr=0.02), True, True),
        ("Muon find_unused=False", "Muon", dict(lr=0.02), False, False),
        ("Shampoo find_unused=False", "Shampoo", dict(lr=3e-3, precondition_frequency=2, start_preconditioning_step=1),
         False, False),
        ("SOAP find_unused=False", "SOAP", dict(lr=3e-3, precondition_frequency=2), False, False),
    )
    out: dict[str, Any] = {}
    # the controls: without them a sync debug mode whose warnings are not captured (a torch that
    # stopped warning, a filter) would count 0 everywhere and every case would pass
    control: dict[str, Any]
    if ctx.cuda:
        x = torch.ones(8, device=dev)
        device_sync(dev)
        control = {"deliberate_item_syncs": _torch_syncs(lambda: x.sum().item(), True),
                   "no_sync_op_syncs": _torch_syncs(lambda: x.add_(1), True)}
        control["ok"] = control["deliberate_item_syncs"] >= 1 and control["no_sync_op_syncs"] == 0
    else:
        control = {"ok": True, "status": "skipped: no CUDA sync debug mode on the CPU (dry run)"}
    ctx.row(case="control: one deliberate .item() counted, x.add_(1) not", **control)
    out["control"] = control
    with w1_group(ctx.backend, dev), force_collectives():
        mesh = init_device_mesh(dev.type, (1,))
        for case, name, kw, unused, find_unused in cases:
            cfg, base = tiny_decoder(0)
            if unused:  # a root-level projection no forward uses
                base.unused = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
            # Muon with bf16 compute, so the gathers run too; Shampoo and SOAP in fp32 (with
            # bf16 compute their CPU dry run took 30 s instead of 1 s)
            mp = {"mp_policy": bf16_mp()} if name == "Muon" else {}
            model = shard_decoder(base.to(dev), mesh, **mp)
            model.set_find_unused_parameters(find_unused)
            opt = getattr(matrixfsdp.optim, name)(model, **kw)
            tokens = tokens_for(cfg, 0, dev, (2, 16))
            lm_loss(model, tokens).backward()  # warm-up: lazy state, first-step allocations
            opt.step()
            opt.zero_grad()
            device_sync(dev)
            per_step = []
            for s in range(steps):
                reads0 = reducer.host_reads[0]
                with _flag_waits() as waits:
                    fb = _torch_syncs(lambda: lm_loss(model, tokens).backward(), ctx.cuda)
                counted = _CountCalls()
                with counted:
                    st = _torch_syncs(opt.step, ctx.cuda)
                opt.zero_grad()
                r = {"step": s, "fwd_bwd_syncs": fb, "step_syncs": st, "host_reads": reducer.host_reads[0] - reads0,
                     "flag_waits": waits["waits"], **counted.calls}
                per_step.append(r)
                ctx.row(case=case, **r)
            reads = sum(r["host_reads"] for r in per_step)
            flag_waits = sum(r["flag_waits"] for r in per_step)
            eigh = sum(r["eigh"] for r in per_step)
            syncs = [r["fwd_bwd_syncs"] for r in per_step] + [r["step_syncs"] for r in per_step]
            expected_reads = steps if unused and find_unused else 0
            problems = []
            if reads != expected_reads:
                problems.append(f"{reads} flag reads, expected {expected_reads}")
            if ctx.cuda and flag_waits != expected_reads:
                problems.append(f"{flag_waits} flag waits, expected {expected_reads}")
            if ctx.cuda:
                if any(r["fwd_bwd_syncs"] for r in per_step):
                    problems.append("torch syncs in forward/backward")
                # declared: one error-flag read per torch.linalg.eigh call, nothing else (qr calls
                # are counted and reported, not excused)
                extra = [r for r in per_step if r["step_syncs"] > r["eigh"]]
                if extra:
                    problems.append(f"step syncs beyond one per eigh: {[(r['step'], r['step_syncs'], r['eigh']) for r in extra]}")
            if name in ("Shampoo", "SOAP") and eigh + sum(r["qr"] for r in per_step) == 0:
                problems.append("no eigh or qr ran: the preconditioner refresh was not exercised")
            out[case] = {"ok": not problems, "problems": problems, "flag_reads": reads, "flag_waits": flag_waits,
                         "eigh_calls": eigh, "qr_calls": sum(r["qr"] for r in per_step), "torch_syncs": None if not ctx.cuda else sum(syncs),
                         "expected": {"flag_reads": expected_reads, "torch_syncs": f"<= eigh calls ({eigh})"}}
    ok = all(v["ok"] for v in out.values())
    cases_key = "; ".join(f"{k.split()[0]}{'' if 'True' in k else '/nofind'}: syncs={v['torch_syncs']} "
                          f"reads={v['flag_reads']}" for k, v in out.items() if k != "control")
    key = (f"control {'ok' if control['ok'] else 'FAILED'}: {control.get('deliberate_item_syncs', 'n/a')} "
           f"sync(s) for one .item(); {cases_key}")
    return {"ok": ok, "steps": steps, "results": out, "key": key}
