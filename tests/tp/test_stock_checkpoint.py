"""Stock torch FSDP2 + TP checkpoints <-> matrixfsdp TP hosting (issue 18; the matrixfsdp side
at dp=1, ``matrixfsdp.tp.host_matrices``).

The stock run: ``parallelize_module`` (ColwiseParallel/RowwiseParallel) on ``mesh["tp"]``, then
``torch.distributed.fsdp.fully_shard`` on ``mesh["dp_shard"]`` of a (dp=2, tp=2) mesh, 4 gloo
ranks; ``torch.optim.Muon`` for the block matrices and ``torch.optim.AdamW`` for the rest; saved
the stock way (``get_state_dict(model, (muon, adamw))`` + ``dcp.save``). matrixfsdp at tp=2 and
tp=3 (hidden width 80: uneven shards) with ``matrixfsdp.optim.Muon(model)`` (the same
hyperparameters, fp32 Newton-Schulz) loads it (``matrixfsdp.checkpoint.load(...,
hparams="optimizer")`` and the plain-DCP recipe of docs/checkpoints.md): parameters and every
state tensor (the hosts' whole momentum buffers, AdamW moments and counters) bitwise. A
matrixfsdp tp=2 checkpoint loads into the stock (2, 2) run the same way. After each load one
more step on both sides gives the same parameters (the stock side's torch Muon switched to fp32
Newton-Schulz for that step, as matrixfsdp's ``ns_dtype=torch.float32``).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp
import matrixfsdp.checkpoint as mckpt
from _harness import get_pool
from tp.test_host_matrices import TPNet, _batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

H = 80  # 80 % 3 != 0: uneven TP shards at tp=3
SAVE_AT = 2
LR, WD, ADAM_LR, ADAM_WD = 0.02, 0.1, 1e-3, 0.01
RESUME_TOL = 1e-5  # relative to the largest entry: a step's reduction-order differences


class Net(TPNet):
    def forward(self, idx, tgt):  # FSDP2's root unit hooks forward
        return self.loss(idx, tgt)


def _parallelize(model, tp_mesh):
    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_params(model):
    return {f: _full(p) for f, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ stock side
def build_stock():
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = Net(H)
    _parallelize(model, mesh["tp"])
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    mats = [p for f, p in model.named_parameters() if f.startswith("blocks.") and p.ndim == 2]
    rest = [p for f, p in model.named_parameters() if not (f.startswith("blocks.") and p.ndim == 2)]
    opts = (torch.optim.Muon(mats, lr=LR, weight_decay=WD),
            torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=ADAM_WD, foreach=False))
    return model, opts, mesh["dp_shard"].get_local_rank()


def stock_step(model, opts, dp, step):
    x, y = _batch(step)  # 4 sequences: each dp rank takes 2 (FSDP2 averages the gradients)
    model(x[2 * dp:2 * dp + 2], y[2 * dp:2 * dp + 2]).backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()


@contextlib.contextmanager
def torch_muon_fp32():
    """torch.optim.Muon with fp32 Newton-Schulz (torch 2.13 hard-codes bf16): the same op
    sequence as matrixfsdp's ``ns_dtype=torch.float32``. Restored on exit (pools are shared)."""
    import torch.optim._muon as tm
    from matrixfsdp.optim._muon import zeropower_via_newtonschulz

    orig = tm._zeropower_via_newtonschulz
    tm._zeropower_via_newtonschulz = lambda g, coeffs, steps, eps: zeropower_via_newtonschulz(
        g, coeffs, steps, eps, torch.float32)
    try:
        yield
    finally:
        tm._zeropower_via_newtonschulz = orig


def stock_state(model, opts):
    """Every state tensor, full (a collective: every rank, the same order)."""
    out = {}
    for o in opts:
        for f, p in model.named_parameters():
            if p in o.state:
                out[f] = {k: _full(v) for k, v in sorted(o.state[p].items())}
    return out


def w_stock_save(root):
    """The stock run: SAVE_AT steps (torch's own Muon), saved the stock way; then one more step."""
    model, opts, dp = build_stock()
    for s in range(SAVE_AT):
        stock_step(model, opts, dp, s)
    msd, osd = get_state_dict(model, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "stock"))
    params, state = full_params(model), stock_state(model, opts)
    with torch_muon_fp32():
        stock_step(model, opts, dp, SAVE_AT)
    return params, state, full_params(model)


def w_stock_from_ours(root):
    """A matrixfsdp TP checkpoint into the stock (2, 2) run: weights (stock DCP calls), then the
    optimizer state with the stock optimizers' own hyperparameters; then one step."""
    out = {}
    path = os.path.join(root, "ours")
    model, opts, dp = build_stock()
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
    out["weights"] = full_params(model)
    # the whole template fails loudly: matrixfsdp's param groups hold other hyperparameter keys
    model2, opts2, _ = build_stock()
    msd2, osd2 = get_state_dict(model2, opts2)
    try:
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
        out["full_template_error"] = None
    except CheckpointException as e:  # a BaseException
        out["full_template_error"] = str(e)
    # state tensors only (the keys and their meaning are torch's: momentum_buffer, exp_avg, ...)
    msd, osd = get_state_dict(model, opts)
    dcp.load({"model": msd, "optim": {"state": osd["state"]}}, checkpoint_id=path)
    set_state_dict(model, opts, model_state_dict=msd, optim_state_dict=osd)
    out["params"], out["state"] = full_params(model), stock_state(model, opts)
    out["lr"] = [o.param_groups[0]["lr"] for o in opts]
    with torch_muon_fp32():
        stock_step(model, opts, dp, SAVE_AT)
    out["next"] = full_params(model)
    return out


# ------------------------------------------------------------------------------------ matrixfsdp side
def build_ours():
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = Net(H)
    _parallelize(model, mesh)
    matrixfsdp.tp.host_matrices(model, mesh)
    opt = matrixfsdp.optim.Muon(model, lr=LR, weight_decay=WD, ns_dtype=torch.float32,
                                adamw_lr=ADAM_LR, adamw_weight_decay=ADAM_WD)
    return model, opt


def ours_step(model, opt, step):
    model(*_batch(step)).backward()
    opt.step()
    opt.zero_grad()


def ours_state(model, opt):
    """This rank's state, whole: a hosted matrix's on its host only, the rest on every rank."""
    out = {}
    for f, p in model.named_parameters():
        st = opt.state.get(p)
        if st:
            out[f] = {k: v.clone() for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)}
    return out


def w_ours_save(root):
    model, opt = build_ours()
    for s in range(SAVE_AT):
        ours_step(model, opt, s)
    mckpt.save(os.path.join(root, "ours"), model, opt)
    params, state = full_params(model), ours_state(model, opt)
    ours_step(model, opt, SAVE_AT)
    return params, state, full_params(model)


def w_ours_from_stock(root, how):
    path = os.path.join(root, "stock")
    model, opt = build_ours()
    out = {"default_error": None}
    if how == "helper":
        try:  # the checkpoint's param groups are torch's: refused, naming the fix
            mckpt.load(path, model, opt)
        except ValueError as e:
            out["default_error"] = str(e)
        mckpt.load(path, model, opt, hparams="optimizer")
    elif how == "weights":
        mckpt.load(path, model)
    else:  # plain DCP: the state tensors, this optimizer's param groups
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": {"state": osd["state"]}}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    out["params"], out["state"] = full_params(model), ours_state(model, opt)
    out["hosted"] = {f: matrixfsdp.tp.tp_host_of(p).is_local for f, p in model.named_parameters()
                     if matrixfsdp.tp.tp_host_of(p) is not None}
    g = opt.param_groups
    out["hparams"] = (g[0]["ns_dtype"], g[1]["adamw_lr"], g[1]["adamw_weight_decay"], g[0]["weight_decay"])
    ours_step(model, opt, SAVE_AT)
    out["next"] = full_params(model)
    return out


# ------------------------------------------------------------------------------------ tests
def _rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def _bitwise(a, b):
    return [k for k in b if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp_stock"))
    params, state, nxt = get_pool(4).run(w_stock_save, root)[0]
    return root, params, state, nxt


def _check_from_stock(res, params, state, nxt, with_state=True):
    for r in res:
        assert r["params"].keys() == params.keys()
        assert not _bitwise(r["params"], params)
        assert r["hparams"] == (torch.float32, ADAM_LR, ADAM_WD, WD)  # the live optimizer's
    if not with_state:
        return
    # each hosted matrix's momentum lives on its host only, whole, and equals the stock buffer
    hosted = res[0]["hosted"]
    assert len(hosted) == 4
    for f in hosted:
        holders = [r for r in res if r["hosted"][f]]
        assert len(holders) == 1 and all(f not in r["state"] for r in res if not r["hosted"][f])
        assert holders[0]["state"][f].keys() == {"momentum_buffer"}
        assert torch.equal(holders[0]["state"][f]["momentum_buffer"], state[f]["momentum_buffer"]), f
    for r in res:  # AdamW moments and counters of the replicated rest, on every rank
        for f in state:
            if f not in hosted:
                assert r["state"][f].keys() == state[f].keys() and not _bitwise(r["state"][f], state[f]), f
    worst = max(_rel(r["next"], nxt) for r in res)
    print("stock -> matrixfsdp, one resumed step, max relative difference:", worst)
    assert worst < RESUME_TOL


@pytest.mark.parametrize("tp", [2, 3])
def test_stock_fsdp2_tp_checkpoint_into_matrixfsdp_tp(stock, tp):
    root, params, state, nxt = stock
    res = get_pool(tp).run(w_ours_from_stock, root, "helper")
    msg = res[0]["default_error"]
    assert msg is not None and "hparams='optimizer'" in msg and "load(path, model)" in msg, msg
    # the same error on every rank (the others name the rank that reported it)
    assert len({r["default_error"].removesuffix(" (reported by rank 0)") for r in res}) == 1, res
    _check_from_stock(res, params, state, nxt)


def test_stock_fsdp2_tp_checkpoint_plain_dcp_and_weights_only(stock):
    root, params, state, nxt = stock
    _check_from_stock(get_pool(2).run(w_ours_from_stock, root, "std"), params, state, nxt)
    _check_from_stock(get_pool(2).run(w_ours_from_stock, root, "weights"), params, state, nxt, with_state=False)


def test_matrixfsdp_tp_checkpoint_into_stock_fsdp2_tp(tmp_path):
    root = str(tmp_path)
    saved = get_pool(2).run(w_ours_save, root)
    params, nxt = saved[0][0], saved[0][2]
    state = {}
    for r in saved:  # hosted matrices' state from their hosts, the rest (on every rank) from any
        for f, st in r[1].items():
            state.setdefault(f, st)
    assert len(state) == len(params)
    res = get_pool(4).run(w_stock_from_ours, root)
    for r in res:
        assert not _bitwise(r["weights"], params)
        assert not _bitwise(r["params"], params)
        assert r["state"].keys() == state.keys()
        for f in state:
            assert r["state"][f].keys() == state[f].keys() and not _bitwise(r["state"][f], state[f]), f
        assert r["full_template_error"] is not None and "betas" in r["full_template_error"]
        assert r["lr"] == [LR, ADAM_LR]  # the stock optimizers' own
    worst = max(_rel(r["next"], nxt) for r in res)
    print("matrixfsdp -> stock, one resumed step, max relative difference:", worst)
    assert worst < RESUME_TOL


def w_state_init(name):
    """get_state_dict on a TP-hosted optimizer without state (torch's state-initialization step,
    which the standard DCP load path calls to build its templates): whole-matrix state on the
    hosts; training then runs as if it had not been called."""
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    out = {}
    for init in (True, False):
        model = Net(H)
        _parallelize(model, mesh)
        matrixfsdp.tp.host_matrices(model, mesh)
        opt = _OPTS[name](model)
        if init:
            get_state_dict(model, opt)
            out["shapes"] = {f: {k: tuple(v.shape) for k, v in opt.state[p].items() if v.ndim}
                             for f, p in model.named_parameters()
                             if matrixfsdp.tp.tp_host_of(p) is not None and p in opt.state}
        for s in range(2):
            ours_step(model, opt, s)
        out[init] = {f: (p._local_tensor if isinstance(p, DTensor) else p).detach().clone()
                     for f, p in model.named_parameters()}
    return out


_OPTS = {
    "muon": lambda m: matrixfsdp.optim.Muon(m, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAM_LR),
    "shampoo": lambda m: matrixfsdp.optim.Shampoo(m, lr=1e-3, precondition_frequency=1),
    "soap": lambda m: matrixfsdp.optim.SOAP(m, lr=1e-3, precondition_frequency=1),
}


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap"])
def test_tp_state_initialization_step_is_whole_matrix(name):
    res = get_pool(2).run(w_state_init, name)
    assert sum(len(r["shapes"]) for r in res) == 4  # each hosted matrix's state on its host
    for r in res:
        for f, shapes in r["shapes"].items():
            rows, cols = (H, 48) if f.endswith("up.weight") else (48, H)
            for k, shape in shapes.items():
                assert shape in {(rows, cols), (rows, rows), (cols, cols)}, (f, k, shape)
        assert not _bitwise(r[True], r[False]), name


def _stock_plain_checkpoint(path, matrix_opt, adam_kw=None):
    """One process, no process group: a plain model stepped once by ``matrix_opt`` (a torch
    optimizer class for the block matrices) + torch AdamW for the rest, saved the stock way."""
    model = Net(H)
    mats = [p for f, p in model.named_parameters() if f.startswith("blocks.") and p.ndim == 2]
    rest = [p for f, p in model.named_parameters() if not (f.startswith("blocks.") and p.ndim == 2)]
    opts = (matrix_opt(mats), torch.optim.AdamW(rest, lr=ADAM_LR, **(adam_kw or {})))
    model(*_batch(0)).backward()
    for o in opts:
        o.step()
    msd, osd = get_state_dict(model, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return full_params(model), {f: dict(o.state[p]) for o in opts for f, p in model.named_parameters() if p in o.state}


def test_other_optimizers_state_is_refused_not_misloaded(tmp_path):
    """hparams='optimizer' loads only state that means the same: torch.optim.Muon + AdamW into
    matrixfsdp's Muon; SGD's momentum_buffer (same key, another meaning), an amsgrad AdamW
    (another key) and Muon state into Shampoo are refused, and the model and optimizer stay
    untouched."""
    muon = lambda ps: torch.optim.Muon(ps, lr=LR)  # noqa: E731
    params, state = _stock_plain_checkpoint(str(tmp_path / "muon"), muon)
    model = Net(H)
    opt = _OPTS["muon"](model)
    with pytest.raises(ValueError, match=r"not written by a matrixfsdp optimizer.*hparams='optimizer'"):
        mckpt.load(str(tmp_path / "muon"), model, opt)
    mckpt.load(str(tmp_path / "muon"), model, opt, hparams="optimizer")
    assert not _bitwise(full_params(model), params)
    for f, p in model.named_parameters():
        assert opt.state[p].keys() == state[f].keys()
        assert all(torch.equal(opt.state[p][k], state[f][k]) for k in state[f]), f
    assert opt.param_groups[0]["ns_dtype"] is torch.float32  # the live hyperparameters
    # a matrixfsdp checkpoint: its recorded routes vouch for the state (every 2D tensor on the
    # 'muon' rule here, embeddings and head too: a parameter list routes by shape)
    ours = matrixfsdp.optim.Muon(model.parameters(), lr=LR, ns_dtype=torch.float32)
    model(*_batch(1)).backward()
    ours.step()
    mckpt.save(str(tmp_path / "ours"), model, ours)
    again = Net(H)
    opt2 = matrixfsdp.optim.Muon(again.parameters(), lr=1.0, ns_dtype=torch.float32)
    mckpt.load(str(tmp_path / "ours"), again, opt2, hparams="optimizer")
    assert not _bitwise(full_params(again), full_params(model)) and opt2.param_groups[0]["lr"] == 1.0
    assert all(torch.equal(opt2.state[q]["momentum_buffer"], ours.state[p]["momentum_buffer"])
               for p, q in zip(model.parameters(), again.parameters()) if p.ndim == 2)

    cases = [
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), None, "muon",
         r"state of 'blocks\.0\.up\.weight' .* written by an optimizer this loader does not know .*'dampening'"),
        ("amsgrad", muon, {"amsgrad": True}, "muon",
         r"state of 'emb\.weight' .* has keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\]"),
        ("maximize", muon, {"maximize": True}, "muon",
         r"state of 'emb\.weight' .* written by torch\.optim\.Adam/AdamW with amsgrad or maximize"),
        ("muon", None, None, "shampoo", r"state of 'blocks\.0\.up\.weight' .* has keys \['momentum_buffer'\]"),
        ("ours", None, None, "muon", r"state of 'emb\.weight' .* has keys \['momentum_buffer'\], but Muon keeps "
         r"\['exp_avg', 'exp_avg_sq', 'step'\] for it \(the 'adamw' rule\)"),
    ]
    for name, make, adam_kw, into, match in cases:
        if make is not None:
            _stock_plain_checkpoint(str(tmp_path / name), make, adam_kw)
        model = Net(H)
        opt = _OPTS[into](model)
        before = full_params(model)
        with pytest.raises(ValueError, match=match):
            mckpt.load(str(tmp_path / name), model, opt, hparams="optimizer")
        assert not _bitwise(full_params(model), before) and not opt.state, name
    with pytest.raises(ValueError, match=r"hparams='optimizer' needs a matrixfsdp.optim optimizer, got AdamW"):
        mckpt.load(str(tmp_path / "muon"), model, torch.optim.AdamW(model.parameters()), hparams="optimizer")
    with pytest.raises(ValueError, match=r"hparams must be 'checkpoint' or 'optimizer', got 'both'"):
        mckpt.load(str(tmp_path / "muon"), model, opt, hparams="both")


# ----------------------------------------------------------- into matrixfsdp.fully_shard + TP (2, 2)
def w_ours_fsdp_from_stock(root):
    """The stock (2, 2) checkpoint into matrixfsdp's own FSDP2 + TP composition at (2, 2)."""
    from tp.test_host_matrices import MLPBlock

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = Net(H)
    _parallelize(model, mesh["tp"])
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(MLPBlock,))
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=LR, weight_decay=WD, ns_dtype=torch.float32,
                                adamw_lr=ADAM_LR, adamw_weight_decay=ADAM_WD)
    mckpt.load(os.path.join(root, "stock"), model, opt, hparams="optimizer")
    dp = mesh["dp_shard"].get_local_rank()
    out = {"params": {f: matrixfsdp.full_tensor(p).detach().clone() for f, p in model.named_parameters()}}
    out["momentum"] = {f: opt.state[p]["momentum_buffer"].clone() for f, p in model.named_parameters()
                       if p in opt.state and "momentum_buffer" in opt.state[p]}
    stock_step(model, (opt,), dp, SAVE_AT)
    out["next"] = {f: matrixfsdp.full_tensor(p).detach().clone() for f, p in model.named_parameters()}
    return out


def test_stock_fsdp2_tp_checkpoint_into_matrixfsdp_fully_shard_tp(stock):
    """Stock FSDP2 + TP (2, 2) -> matrixfsdp.fully_shard + TP (2, 2): parameters bitwise, each TP
    matrix's momentum whole on exactly one rank (its owner row's host) and bitwise, one resumed
    step within reduction-order noise."""
    root, params, state, nxt = stock
    res = get_pool(4).run(w_ours_fsdp_from_stock, root)
    for r in res:
        assert not _bitwise(r["params"], params)
    holders = {}
    for r in res:
        for f, m in r["momentum"].items():
            holders.setdefault(f, []).append(m)
    assert sorted(holders) == sorted(f for f in state if "momentum_buffer" in state[f])
    for f, ms in holders.items():
        assert len(ms) == 1 and torch.equal(ms[0], state[f]["momentum_buffer"]), f
    worst = max(_rel(r["next"], nxt) for r in res)
    print("stock -> matrixfsdp fully_shard + TP, one resumed step, max relative difference:", worst)
    assert worst < RESUME_TOL
