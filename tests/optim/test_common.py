"""Behaviour shared by Muon, Shampoo and SOAP: routing, the AdamW rule, empty and DTensor
parameters, validation messages and state-dict round trips."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from matrixfsdp.optim import SOAP, Muon, Shampoo


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices gain nothing from intra-op threads, and spinning threads on a busy 2-core box
    make this module ~15x slower; restore the setting for other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

ALL = [Muon, Shampoo, SOAP]
# Small, fast settings; Shampoo preconditions from step 1 so every code path runs.
FAST = {
    Muon: {"ns_dtype": torch.float32},
    Shampoo: {"start_preconditioning_step": 1, "precondition_frequency": 2},
    SOAP: {"precondition_frequency": 2},
}
MATRIX_STATE_KEY = {Muon: "momentum_buffer", Shampoo: "L", SOAP: "QL"}


def _params(*shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params] for _ in range(n)]


def _step(opts_params, grads):
    for opt, params in opts_params:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


# ---------------------------------------------------------------------------------- exports


def test_exports():
    import matrixfsdp.optim as optim

    assert set(optim.__all__) == {"Muon", "Shampoo", "SOAP", "UpdateRule", "ShardedStateRule"}
    for cls in ALL:
        assert issubclass(cls, torch.optim.Optimizer)
        assert "Example" in cls.__doc__


# ---------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("cls", ALL)
def test_auto_routing_and_adamw_group(cls):
    weight, bias, emb, scalar = _params((24, 40), (24,), (48, 32), ())
    opt = cls(
        [{"params": [weight, bias, scalar]}, {"params": [emb], "algorithm": "adamw"}],
        lr=1e-2,
        **FAST[cls],
    )
    _step([(opt, [weight, bias, emb, scalar])], _grads([weight, bias, emb, scalar], 1)[0])
    assert MATRIX_STATE_KEY[cls] in opt.state[weight]
    for p in (bias, emb, scalar):
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, p.shape


@pytest.mark.parametrize("cls", ALL)
def test_explicit_rule_group_rejects_non_matrix(cls):
    weight, bias = _params((24, 40), (16,))
    with pytest.raises(ValueError, match=rf"param group 1 asks for the '{cls.rule}' rule.*shape \(16,\)"):
        cls([{"params": [weight]}, {"params": [bias], "algorithm": cls.rule}])
    opt = cls([{"params": [weight], "algorithm": cls.rule}])  # 2D is fine
    assert opt.param_groups[0]["algorithm"] == cls.rule


@pytest.mark.parametrize("cls", ALL)
def test_unknown_algorithm(cls):
    (weight,) = _params((4, 4))
    with pytest.raises(ValueError, match=rf"{cls.__name__}: algorithm must be one of .*got algorithm='sgd' \(param group 0\)"):
        cls([{"params": [weight], "algorithm": "sgd"}])


@pytest.mark.parametrize("cls", ALL)
def test_failed_add_param_group_leaves_optimizer_unchanged(cls):
    weight, bias = _params((4, 4), (4,))
    opt = cls([weight])
    with pytest.raises(ValueError, match=r"lr must be a float >= 0, got lr=-1 \(param group 1\)"):
        opt.add_param_group({"params": [bias], "lr": -1})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [bias]})
    assert len(opt.param_groups) == 2


# ---------------------------------------------------------------------------------- AdamW rule


@pytest.mark.parametrize("cls", ALL)
def test_adamw_rule_bitwise_torch_adamw(cls):
    """1D, 0-dim and algorithm='adamw' 2D params: bitwise torch.optim.AdamW(foreach=False)."""
    ours = _params((24,), (), (48, 32), (7, 3, 5))
    ref = _clone(ours)
    hp = {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    opt = cls(
        [{"params": ours[:2] + ours[3:]}, {"params": [ours[2]], "algorithm": "adamw"}],
        lr=0.5,  # the matrix rule's; AdamW has its own below
        weight_decay=0.5,
        adamw_lr=hp["lr"],
        adamw_betas=hp["betas"],
        adamw_eps=hp["eps"],
        adamw_weight_decay=hp["weight_decay"],
    )
    torch_opt = torch.optim.AdamW([ref[0], ref[1], ref[3], ref[2]], foreach=False, **hp)
    for grads in _grads(ours, 5):
        _step([(opt, ours), (torch_opt, ref)], grads)
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"])
        assert torch.equal(opt.state[p]["step"], torch_opt.state[q]["step"])


@pytest.mark.parametrize("cls", ALL)
def test_adamw_defaults_follow_group_lr_and_weight_decay(cls):
    """adamw_lr / adamw_weight_decay default to None: the group's lr / weight_decay, read at every
    step (so an LR scheduler drives both rules); betas (0.9, 0.999), eps 1e-8."""
    ours = _params((24,), (8,))
    ref = _clone(ours)
    opt = cls([{"params": [ours[0]]}, {"params": [ours[1]], "lr": 2e-2, "weight_decay": 0.3}], lr=1e-2, weight_decay=0.2)
    torch_opt = torch.optim.AdamW(
        [{"params": [ref[0]]}, {"params": [ref[1]], "lr": 2e-2, "weight_decay": 0.3}],
        lr=1e-2,
        weight_decay=0.2,
        foreach=False,
    )
    assert opt.defaults["adamw_betas"] == (0.9, 0.999) and opt.defaults["adamw_eps"] == 1e-8
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, torch_opt)]
    for grads in _grads(ours, 5):
        _step([(opt, ours), (torch_opt, ref)], grads)
        for s in schedulers:
            s.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)


def test_muon_with_only_torch_arguments():
    """The torch.optim.Muon spelling on model.parameters(): 2D -> Muon (bitwise torch), the rest ->
    AdamW with lr=lr, weight_decay=weight_decay, betas (0.9, 0.999), eps 1e-8."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.GELU(), torch.nn.Linear(24, 8))
    ref = copy.deepcopy(model)
    kw = {"lr": 0.02, "weight_decay": 0.05, "momentum": 0.9, "nesterov": False, "ns_steps": 4}
    opt = Muon(model.parameters(), **kw)
    ref_2d = [p for p in ref.parameters() if p.ndim == 2]
    ref_1d = [p for p in ref.parameters() if p.ndim != 2]
    ref_muon = torch.optim.Muon(ref_2d, **kw)
    ref_adamw = torch.optim.AdamW(ref_1d, lr=kw["lr"], weight_decay=kw["weight_decay"], foreach=False)
    x = torch.randn(16, 40)
    for _ in range(3):
        for m in (model, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------- skipping


@pytest.mark.parametrize("cls", ALL)
def test_empty_and_gradless_params_are_skipped(cls):
    empty_matrix = torch.nn.Parameter(torch.zeros(0, 40))  # a non-owner's [0, n] shard
    empty_vector = torch.nn.Parameter(torch.zeros(0))
    no_grad, weight = _params((24, 40), (24, 40))
    opt = cls([empty_matrix, empty_vector, no_grad, weight], **FAST[cls])
    before = no_grad.detach().clone()
    for _ in range(3):
        empty_matrix.grad = torch.zeros(0, 40)
        empty_vector.grad = torch.zeros(0)
        weight.grad = torch.randn(24, 40)
        opt.step()
    for p in (empty_matrix, empty_vector, no_grad):
        assert p not in opt.state  # not even an empty dict
    assert torch.equal(no_grad, before)
    assert list(opt.state_dict()["state"]) == [3]


# ---------------------------------------------------------------------------------- validation

COMMON_ERRORS = [
    ({"lr": -1.0}, r"lr must be a float >= 0, got lr=-1.0"),
    ({"lr": torch.tensor(0.1)}, r"lr must be a float >= 0, got lr=tensor\(0.1000\)"),
    ({"weight_decay": -0.1}, r"weight_decay must be a float >= 0, got weight_decay=-0.1"),
    ({"adamw_lr": -2.0}, r"adamw_lr must be a float >= 0, got adamw_lr=-2.0"),
    ({"adamw_betas": (0.9, 1.0)}, r"adamw_betas must be two floats in \[0, 1\), got adamw_betas=\(0.9, 1.0\)"),
    ({"adamw_eps": -1e-8}, r"adamw_eps must be a float >= 0, got adamw_eps=-1e-08"),
    ({"adamw_weight_decay": "x"}, r"adamw_weight_decay must be a float >= 0, got adamw_weight_decay='x'"),
]


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize(("kwargs", "message"), COMMON_ERRORS)
def test_common_validation(cls, kwargs, message):
    (weight,) = _params((4, 4))
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {message}$"):
        cls([weight], **kwargs)
    # The same value as a per-group override names the group.
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {message} \(param group 0\)$"):
        cls([{"params": [weight], **kwargs}])


@pytest.mark.parametrize("cls", ALL)
def test_complex_params_rejected(cls):
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        cls([p])


@pytest.mark.parametrize("cls", ALL)
def test_sparse_grad_rejected(cls):
    (p,) = _params((4, 4))
    opt = cls([p])
    p.grad = torch.eye(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


# ---------------------------------------------------------------------------------- state dict


def _make(cls, params, lr=1e-2):
    return cls(
        [{"params": params[:2]}, {"params": params[2:], "algorithm": "adamw", "lr": 1e-3}],
        lr=lr,
        weight_decay=0.1,
        **FAST[cls],
    )


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(cls, dtype):
    """Load another optimizer's state mid-run (through torch.save), then both produce identical
    bits, across precondition/refresh boundaries; wide (fp32) statistics keep their dtype."""
    a = _params((24, 40), (48, 32), (32, 24), (40,), dtype=dtype)
    grads = _grads(a, 9)
    opt_a = _make(cls, a)
    for g in grads[:4]:
        _step([(opt_a, a)], g)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b = _clone(a)
    opt_b = _make(cls, b, lr=123.0)  # hyperparameters come from the state dict
    opt_b.load_state_dict(torch.load(buf, weights_only=False))
    assert opt_b.param_groups[0]["lr"] == 1e-2
    for pa, pb in zip(a, b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype, k
            assert torch.equal(sa[k], sb[k]), k
            assert sa[k] is not sb[k]
    for g in grads[4:]:
        _step([(opt_a, a), (opt_b, b)], g)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        for k, v in opt_a.state[pa].items():
            assert torch.equal(v, opt_b.state[pb][k]), k


def test_wide_state_is_float32_for_bf16_params():
    (p,) = _params((8, 6), dtype=torch.bfloat16)
    for cls in (Shampoo, SOAP):
        opt = cls([p], **FAST[cls])
        for _ in range(2):
            p.grad = torch.randn(8, 6, dtype=torch.bfloat16)
            opt.step()
        assert {k: v.dtype for k, v in opt.state[p].items() if k != "step"} == dict.fromkeys(
            (k for k in opt.state[p] if k != "step"), torch.float32
        )
        assert p.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- DTensor


@pytest.fixture(scope="module")
def mesh():
    """A 1-rank gloo mesh: enough to build DTensors whose local tensors we choose."""
    from torch.distributed.tensor import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def _dtensor_param(local, mesh, shape=None, owned="matrix"):
    """A DTensor parameter with the local tensor we choose; ``owned`` attaches matrixfsdp's
    ``Owned`` metadata (what ``fully_shard`` does), ``None`` leaves an evenly sharded one."""
    from torch.distributed.tensor import DTensor, Shard

    from matrixfsdp import Owned

    shape = torch.Size(shape if shape is not None else local.shape)
    stride = torch.empty(shape, device="meta").stride()
    p = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride))
    if owned is not None:
        p._matrixfsdp_owned = Owned(owner=0, kind=owned)
    return p


def _dtensor_grad(p, local):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class _NoDTensorOps(TorchDispatchMode):
    """Records every aten op that sees a DTensor argument (those could communicate)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cls", ALL)
def test_dtensor_params_update_local_tensors_without_communication(cls, mesh):
    from torch.distributed.tensor.debug import CommDebugMode

    w, b = _params((24, 40), (40,))
    plain = _clone([w, b])
    owned = _dtensor_param(w.detach().clone(), mesh)
    shard = _dtensor_param(b.detach().clone(), mesh, owned=None)  # an "even" 1D shard, AdamW
    empty = _dtensor_param(torch.zeros(0, 40), mesh, shape=(48, 40))  # non-owner of a 48x40 matrix
    opt = cls([owned, shard, empty], **FAST[cls])
    ref = cls(plain, **FAST[cls])
    for grads in _grads(plain, 4):
        for p, g in zip(plain, grads):
            p.grad = g.clone()
        owned.grad = _dtensor_grad(owned, grads[0].clone())
        shard.grad = _dtensor_grad(shard, grads[1].clone())
        empty.grad = _dtensor_grad(empty, torch.zeros(0, 40))
        with CommDebugMode() as comm, _NoDTensorOps() as ops:
            opt.step()
        ref.step()
        assert comm.get_total_counts() == 0
        assert ops.seen == []
    assert torch.equal(owned.to_local(), plain[0])
    assert torch.equal(shard.to_local(), plain[1])
    assert empty not in opt.state
    assert all(not isinstance(v, type(owned)) for v in opt.state[owned].values())


@pytest.mark.parametrize("cls", ALL)
def test_dtensor_partial_matrix_rejected(cls, mesh):
    part = _dtensor_param(torch.zeros(3, 40), mesh, shape=(48, 40))
    with pytest.raises(ValueError, match=r"needs the whole matrix on one rank.*global shape \(48, 40\) and local shape \(3, 40\)"):
        cls([part])
    # Routed to AdamW, a partial shard is fine (evenly sharded element-wise update).
    opt = cls([{"params": [part], "algorithm": "adamw"}])
    part.grad = _dtensor_grad(part, torch.ones(3, 40))
    opt.step()
    assert opt.state[part]["exp_avg"].shape == (3, 40)


def test_dtensor_routing_uses_global_shape(mesh):
    # Global 2D (owner's full matrix) but the local tensor of a non-owner is [0, n]: still "matrix".
    empty = _dtensor_param(torch.zeros(0, 8), mesh, shape=(16, 8))
    opt = Muon([{"params": [empty], "algorithm": "muon"}])  # no "must be 2D" error
    assert opt._route(opt.param_groups[0], empty) == "muon"


@pytest.mark.parametrize("cls", ALL)
def test_bf16_params_with_default_settings(cls):
    """Mixed-dtype paths (bf16 params, fp32 statistics, AdamW warm-up of Shampoo) run and stay finite."""
    w, b = _params((8, 6), (6,), dtype=torch.bfloat16)
    opt = cls([w, b])
    for grads in _grads([w, b], 12):
        _step([(opt, [w, b])], grads)
    assert w.dtype == b.dtype == torch.bfloat16
    assert w.isfinite().all() and b.isfinite().all()


def test_auto_routing_follows_the_owner_plan(mesh):
    """Under fully_shard, "auto" obeys the plan: owned matrices -> the matrix rule; owned tails and
    evenly sharded 2D tensors (embeddings, heads the planner's matrix_filter excluded) -> AdamW."""
    matrix = _dtensor_param(torch.zeros(4, 8), mesh, owned="matrix")
    tail_2d = _dtensor_param(torch.zeros(4, 8), mesh, owned="tail")
    even_2d = _dtensor_param(torch.zeros(4, 8), mesh, owned=None)
    plain_2d = torch.nn.Parameter(torch.zeros(4, 8))
    opt = Muon([matrix, tail_2d, even_2d, plain_2d])
    g = opt.param_groups[0]
    assert [opt._route(g, p) for p in (matrix, tail_2d, even_2d, plain_2d)] == ["muon", "adamw", "adamw", "muon"]


@pytest.mark.parametrize("cls", ALL)
def test_dcp_state_init_step_changes_nothing(cls):
    """torch's get_state_dict() on a fresh optimizer runs step() with zero grads and lr=0 to
    create state; that must not move parameters, advance counters or seed SOAP's bases: training
    afterwards is bitwise the same as without it (explicit adamw_lr and weight decay included)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Linear(20, 6))
    twin = copy.deepcopy(model)
    kw = {**FAST[cls], "weight_decay": 0.1, "adamw_lr": 1e-2, "adamw_weight_decay": 0.05}
    opt, ref = cls(model.parameters(), **kw), cls(twin.parameters(), **kw)
    before = [p.detach().clone() for p in model.parameters()]
    _, osd = get_state_dict(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert len(osd["state"]) == 4  # templates exist for DCP to load into
    x = torch.randn(5, 12)
    for _ in range(4):
        for m, o in ((model, opt), (twin, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
