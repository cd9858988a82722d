"""Newton-Schulz schedules ([Note: Newton-Schulz schedules] in optim/newton_schulz.py): the
published coefficients, how ns_steps resolves each, the exact spectral map of every iteration path
(per-matrix, batched, Gram) against a float64 closed form, the documented singular-value bands,
Muon's steps (per-matrix, batched, Gram, capturable, expert stack), product counts, state dicts and
the error messages."""

from __future__ import annotations

import copy
import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from matrixfsdp.optim import Muon
from matrixfsdp.optim.newton_schulz import (
    CUBIC5,
    POLAR_EXPRESS,
    POLAR_EXPRESS_LIMIT,
    POLAR_EXPRESS_SAFETY,
    QUINTIC,
    Schedule,
    batched_newtonschulz,
    gram_newtonschulz,
    resolve_schedule,
    zeropower_via_newtonschulz,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


NAMED = ["quintic", "polar_express", "cubic5"]
EXPLICIT = [(3.0, -3.2, 1.2), (2.5, -1.5, 0.0), (2.0, -1.2, 0.3), (1.875, -1.25, 0.375), (1.5, -0.5, 0.0)]
SCHEDULES = [*NAMED, EXPLICIT]
IDS = [*NAMED, "explicit"]


# ------------------------------------------------------------------------------ published values
def _minimax_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """The odd quintic a x + b x^3 + c x^5 closest to 1 in max norm on [lo, hi] (Remez: the error
    equioscillates at lo < q < r < hi, q and r the extrema of the polynomial)."""
    if lo / hi >= 1 - 5e-6:
        return 15 / 8 / hi, -10 / 8 / hi**3, 3 / 8 / hi**5
    q, r, err = (3 * lo + 1) / 4, (lo + 3) / 4, None
    for _ in range(100):
        pts = ((lo, 1.0), (q, -1.0), (r, 1.0), (hi, -1.0))
        m = torch.tensor([[x, x**3, x**5, s] for x, s in pts], dtype=torch.float64)
        a, b, c, e = torch.linalg.solve(m, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(9 * b * b - 20 * a * c)
        q, r = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
        if err is not None and abs(e - err) <= 1e-15:
            break
        err = e
    return a, b, c


def _polar_express(l0: float, steps: int, safety: float, cushion: float) -> list[tuple[float, float, float]]:
    """Algorithm 1 of arXiv:2505.16932 (Polar Express), as described there: greedy minimax quintics
    on the interval the previous ones leave, floored at cushion * u and recentred, all but the last
    divided by the safety factor (a / s, b / s^3, c / s^5). Our own code."""
    lo, hi, out = l0, 1.0, []
    for k in range(steps):
        a, b, c = _minimax_quintic(max(lo, cushion * hi), hi)
        if cushion * hi > lo:  # recentre: p(lo) and p(hi) symmetric about 1
            p = lambda x: a * x + b * x**3 + c * x**5  # noqa: E731
            scale = 2 / (p(lo) + p(hi))
            a, b, c = a * scale, b * scale, c * scale
        if k < steps - 1:
            a, b, c = a / safety, b / safety**3, c / safety**5
        out.append((a, b, c))
        lo = a * lo + b * lo**3 + c * lo**5
        hi = 2 - lo
    return out


def test_quintic_is_torch_muons_default():
    assert inspect.signature(torch.optim.Muon).parameters["ns_coefficients"].default == QUINTIC
    assert inspect.signature(Muon).parameters["ns_coefficients"].default == QUINTIC
    assert resolve_schedule("quintic", 5) == resolve_schedule(QUINTIC, 5) == Schedule((QUINTIC,) * 5, 1.0)


def test_polar_express_is_the_published_construction():
    """The 5-step list of modded-nanogpt/nanochat/dion ("num_iters=5, safety_factor=2e-2") is
    Algorithm 1 of arXiv:2505.16932 from l0 = 1e-3 with cushion 0.02 and safety 1.02; the limit
    polynomial is the construction on an interval shrunk to 1."""
    expected = _polar_express(1e-3, 5, 1.02, 0.02)
    assert len(POLAR_EXPRESS) == 5 and POLAR_EXPRESS_SAFETY == 1.02
    for got, want in zip(POLAR_EXPRESS, expected):
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert POLAR_EXPRESS[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)  # as printed
    assert POLAR_EXPRESS_LIMIT == pytest.approx(_minimax_quintic(1.0, 1.0), rel=1e-15)


def _compose(coefficients, x: torch.Tensor) -> torch.Tensor:
    for a, b, c in coefficients:
        x = a * x + b * x**3 + c * x**5
    return x


def test_cubic5_is_the_published_schedule():
    """arXiv:2606.00371 (values as in NVIDIA-NeMo/Emerging-Optimizers PR #217): five cubic steps,
    which map singular values in [7e-3, 1] (relative to the norm) into its relaxed band."""
    assert CUBIC5 == (
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    )
    y = _compose(CUBIC5, torch.logspace(math.log10(7e-3), 0, 20001, dtype=torch.float64))
    assert 0.774 < y.min() < 0.7742 and 1.2999 < y.max() <= 1.3
    assert resolve_schedule("cubic5", 5).products == 10 and resolve_schedule("quintic", 5).products == 15


# Documented bands (docs/optimizers.md, "Newton-Schulz schedules"): singular values of the exact
# 5-step map for input singular values (relative to the Frobenius norm) in [7e-3, 1].
BANDS = {"quintic": (0.681, 1.135), "polar_express": (0.858, 1.142), "cubic5": (0.774, 1.300)}


@pytest.mark.parametrize("name", NAMED)
def test_documented_band_of_the_exact_map(name):
    s = resolve_schedule(name, 5)
    y = _compose(s.coefficients, torch.logspace(math.log10(7e-3), 0, 20001, dtype=torch.float64) / s.norm_scale)
    lo, hi = BANDS[name]
    assert lo <= y.min() < lo + 2e-3 and hi - 2e-3 < y.max() <= hi


# ------------------------------------------------------------------------------ ns_steps
def test_ns_steps_resolution():
    pe = resolve_schedule("polar_express", 3)
    assert pe == Schedule(POLAR_EXPRESS[:3], 1.02)  # fewer steps: its first ones
    assert resolve_schedule("polar_express", 7).coefficients == POLAR_EXPRESS + (POLAR_EXPRESS_LIMIT,) * 2
    assert resolve_schedule("polar_express", 0) == Schedule((), 1.02)
    assert resolve_schedule((1.0, 2.0, 3.0), 2) == Schedule(((1.0, 2.0, 3.0),) * 2)
    assert resolve_schedule([[1.0, 2.0, 3.0], (4.0, 5.0, 0.0)], 2) == Schedule(((1.0, 2.0, 3.0), (4.0, 5.0, 0.0)))
    assert resolve_schedule("cubic5", 5) == Schedule(CUBIC5, 1.0)


def test_polar_express_longer_runs_converge():
    """More steps than the list: the limit quintic drives singular values to 1; the 5th tuple
    repeated would settle near its fixed point 1.035."""
    x = torch.logspace(-3, 0, 2001, dtype=torch.float64) / POLAR_EXPRESS_SAFETY
    y = _compose(resolve_schedule("polar_express", 8).coefficients, x)
    assert (y - 1).abs().max() < 1e-12
    repeated = _compose(POLAR_EXPRESS + (POLAR_EXPRESS[-1],) * 12, x)
    assert (repeated - 1).abs().min() > 0.03 and (repeated - 1.035).abs().max() < 3e-3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ns_coefficients": "polar"},
         r"ns_coefficients must be one of the schedules \('quintic', 'polar_express', 'cubic5'\), "
         r"got ns_coefficients='polar'"),
        ({"ns_coefficients": "cubic5", "ns_steps": 4},
         r"ns_coefficients='cubic5' is a fixed 5-step schedule, got ns_steps=4; set ns_steps=5, or pass "
         r"a list of \(a, b, 0.0\) triples, one per iteration"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0)] * 3},
         r"ns_coefficients lists 3 iterations, but ns_steps=5: a per-iteration list fixes the number of "
         r"iterations; set ns_steps=3"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0), (1.0, 2.0)], "ns_steps": 2},
         r"ns_coefficients as a per-iteration list must hold \(a, b, c\) triples of floats, but entry 1 is "
         r"\(1.0, 2.0\), in ns_coefficients=\[\(1.0, 2.0, 3.0\), \(1.0, 2.0\)\]"),
        ({"ns_coefficients": []},
         r"ns_coefficients must be three floats \(a, b, c\), one of \('quintic', 'polar_express', 'cubic5'\) "
         r"or a list of \(a, b, c\) triples, one per iteration, got ns_coefficients=\[\]"),
        ({"ns_coefficients": None},
         r"ns_coefficients must be three floats \(a, b, c\), one of \('quintic', 'polar_express', 'cubic5'\) "
         r"or a list of \(a, b, c\) triples, one per iteration, got ns_coefficients=None"),
        ({"ns_coefficients": (1.0, float("nan"), 2.0)}, r"ns_coefficients must be finite, got ns_coefficients=\(1.0, nan, 2.0\)"),
        ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients must be three floats, got ns_coefficients=\(1.0, 2.0\)"),
    ],
)
def test_errors(kwargs, message):
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=rf"^Muon: {message}$"):
        Muon([p], **kwargs)
    with pytest.raises(ValueError, match=rf"^Muon: {message} \(param group 1\)$"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))]}, {"params": [p], **kwargs}])
    with pytest.raises(ValueError, match=rf"^resolve_schedule: {message}$"):
        resolve_schedule(kwargs["ns_coefficients"], kwargs.get("ns_steps", 5))


# ------------------------------------------------------------------------------ the iterations
def _spread(shape, lo=7e-3, seed=0) -> torch.Tensor:
    """A float32 matrix (or stack) whose singular values relative to its Frobenius norm span
    [lo, 1/2] log-uniformly (so every schedule's band applies)."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(*batch, m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(*batch, n, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, math.log10(lo * 2), k, dtype=torch.float64)
    s = s / s.norm() / 2 * (1 / (1 - 1 / 4)) ** 0.5  # largest relative value ~1/2: all within [lo, 1]
    return ((u * s) @ v.mT).float()


def _closed_form(x: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """U p(S / (s ||X||)) V^T in float64: what every iteration path computes, in exact arithmetic."""
    x = x.double()
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).squeeze(-1)
    return (u * _compose(schedule.coefficients, sv / (norm * schedule.norm_scale)).unsqueeze(-2)) @ vh


PATHS = {
    "standard": (zeropower_via_newtonschulz, (24, 56)),
    "standard_tall": (zeropower_via_newtonschulz, (56, 24)),
    "batched": (batched_newtonschulz, (3, 24, 56)),
    "gram": (gram_newtonschulz, (24, 72)),
    "gram_tall": (gram_newtonschulz, (72, 24)),
    "gram_stack": (gram_newtonschulz, (3, 24, 72)),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("coefficients", SCHEDULES, ids=IDS)
def test_each_path_is_the_schedules_polynomial(path, coefficients):
    """float32 output within round-off of U p(S) V^T (float64), and the distance from the polar
    factor within the documented band's bound."""
    fn, shape = PATHS[path]
    x = _spread(shape)
    schedule = resolve_schedule(coefficients, 5)
    out = fn(x, coefficients, 5, 1e-7, torch.float32)
    assert out.dtype == torch.float32 and out.shape == x.shape
    # measured on 3 seeds: up to 2.3e-6 (quintic), 1.7e-6 (cubic5), 1.1e-5 (Polar Express, whose
    # first coefficients are the largest; Gram on the tall matrix)
    torch.testing.assert_close(out.double(), _closed_form(x, schedule), rtol=0, atol=2e-5)
    if isinstance(coefficients, str):
        lo, hi = BANDS[coefficients]
        s = torch.linalg.svdvals(out.double())
        assert lo - 1e-4 < s.min() and s.max() < hi + 1e-4
        u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
        polar = u @ vh
        dist = (out.double() - polar).norm() / polar.norm()
        assert dist <= max(1 - lo, hi - 1)


@pytest.mark.parametrize("coefficients", NAMED)
def test_bf16_stays_near_the_exact_map(coefficients):
    """bfloat16 (Muon's default dtype) on a Gaussian matrix: within a few percent of the float64
    map, and as far from the polar factor as the band allows (measured, relative Frobenius: standard
    0.011-0.028 from the map, Gram 0.034-0.067, Polar Express the largest of each)."""
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    exact = _closed_form(x, resolve_schedule(coefficients, 5))
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    lo, hi = BANDS[coefficients]
    for fn, bound in ((zeropower_via_newtonschulz, 0.04), (gram_newtonschulz, 0.1)):
        out = fn(x, coefficients, 5, 1e-7, torch.bfloat16).double()
        assert (out - exact).norm() / exact.norm() < bound
        assert (out - u @ vh).norm() / (u @ vh).norm() < max(1 - lo, hi - 1)


class _CountMatmuls(TorchDispatchMode):
    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("fn", "shape", "counts"), [
    (zeropower_via_newtonschulz, (24, 56), {"quintic": 15, "polar_express": 15, "cubic5": 10}),
    (batched_newtonschulz, (2, 24, 56), {"quintic": 15, "polar_express": 15, "cubic5": 10}),
    # Gram: R_0, per step R^2 (quintic only), Q P (after the first), R P and P (R P) (not in the
    # last step, nor before the restart), the restart (Q X, R) and the final Q X: 18, 13 cubic
    (gram_newtonschulz, (24, 72), {"quintic": 18, "polar_express": 18, "cubic5": 13}),
], ids=["standard", "batched", "gram"])
def test_cubic_iterations_take_two_products(fn, shape, counts):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    got = {}
    for name in counts:
        with _CountMatmuls() as mode:
            fn(x, name, 5, 1e-7, torch.float32)
        got[name] = mode.count
    assert got == counts


# ------------------------------------------------------------------------------ Muon's steps
MODES = ["per_matrix", "batched", "gram", "capturable", "experts"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("coefficients", SCHEDULES, ids=IDS)
def test_muon_step_runs_the_schedule(mode, coefficients):
    """One Muon step (fp32 NS, Nesterov) in every step mode equals the closed form
    W (1 - lr wd) - lr sqrt(max(1, m/n)) U p(S) V^T of its update."""
    shape = (2, 24, 40) if mode == "experts" else (24, 40)
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for _ in range(2)]
    start = [p.detach().clone() for p in params]
    lr, wd, momentum = 0.02, 0.1, 0.9
    kw = {"experts": 1} if mode == "experts" else {"batched": True} if mode == "batched" else {}
    opt_kw = {"ns_method": "gram"} if mode == "gram" else {}
    if mode == "capturable":
        opt_kw.update(capturable=True, lr=torch.tensor(lr))
    opt = Muon([{"params": params, **kw}], **{"lr": lr, **opt_kw}, weight_decay=wd, momentum=momentum,
               ns_coefficients=coefficients, ns_dtype=torch.float32)
    grads = [torch.randn(shape, generator=g) for _ in params]
    for p, grad in zip(params, grads):
        p.grad = grad
    opt.step()
    schedule = resolve_schedule(coefficients, 5)
    for p, w, grad in zip(params, start, grads):
        update = grad.double().lerp((1 - momentum) * grad.double(), momentum)  # nesterov, first step
        expected = w.double() * (1 - lr * wd) - lr * _closed_form(update, schedule)  # (wide: ratio 1)
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("coefficients", ["polar_express", [tuple(t) for t in CUBIC5]], ids=["name", "tuples"])
def test_state_dict_round_trip(coefficients):
    """Param groups carry the schedule as given (a string, tuples); a loaded one -- also as lists,
    as a JSON round trip gives them -- steps on as the optimizer that saved it."""
    grads = [torch.randn(16, 48, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]

    def make():
        p = torch.nn.Parameter(torch.randn(16, 48, generator=torch.Generator().manual_seed(4)))
        return p, Muon([p], lr=0.02, ns_coefficients=coefficients, ns_dtype=torch.float32)

    ref, ref_opt = make()
    for grad in grads:
        ref.grad = grad
        ref_opt.step()
    saver, opt = make()
    saver.grad = grads[0]
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["ns_coefficients"] == coefficients
    as_lists = coefficients if isinstance(coefficients, str) else [list(t) for t in coefficients]
    for value in (coefficients, as_lists):
        saved = copy.deepcopy(sd)
        saved["param_groups"][0]["ns_coefficients"] = value
        p, fresh = make()
        with torch.no_grad():
            p.copy_(saver)
        fresh.load_state_dict(saved)
        assert fresh.param_groups[0]["ns_coefficients"] == value
        p.grad = grads[1]
        fresh.step()
        assert torch.equal(p, ref)


def test_docs_example_runs():
    """The example of docs/optimizers.md's "Newton-Schulz schedules" section runs as printed."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text()
    section = text.split("## Newton-Schulz schedules", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.+?)\n```", section, flags=re.S)
    assert code is not None
    exec(compile(code.group(1), "docs/optimizers.md", "exec"), {})
