"""torch 2.11's DTensor dispatch never calls a DTensor subclass's own ``__torch_dispatch__``;
matrixfsdp routes ops on its owned tensors and expert stacks there itself ([Note: DTensor
subclasses on torch 2.11] in ``placement/_compat.py``). The probe that switches the route is
pinned per release, and the route itself runs here on whatever release runs the suite."""

from __future__ import annotations

import pytest
import torch

from _harness import get_pool

from matrixfsdp.placement import _compat

# read from each release's torch/distributed/tensor/_api.py and measured (DTensor subclass results)
_SUBCLASS_DISPATCH = {"2.11": False, "2.13": True, "2.14": True, "2.15": True}


def test_the_probe_matches_the_releases_it_was_read_on():
    release = ".".join(torch.__version__.split(".")[:2])
    if release not in _SUBCLASS_DISPATCH:
        pytest.skip(f"torch {torch.__version__}: its DTensor dispatch was not read")
    assert _compat.subclass_dispatch() is _SUBCLASS_DISPATCH[release]


def on_the_211_route(fn, *args):
    """``fn(*args)`` with the torch-2.11 route on (a no-op change on 2.11 itself)."""
    from matrixfsdp.placement.experts import ExpertDTensor
    from matrixfsdp.placement.owned_tensor import OwnedDTensor

    classes = (OwnedDTensor, ExpertDTensor)
    saved = _compat.subclass_dispatch(), [c.__dict__.get("__torch_function__") for c in classes]
    _compat._SUBCLASS_DISPATCH = False
    for c in classes:
        c.__torch_function__ = classmethod(_compat.subclass_torch_function)
    try:
        return fn(*args)
    finally:
        _compat._SUBCLASS_DISPATCH = saved[0]
        for c, tf in zip(classes, saved[1]):
            if tf is None:
                del c.__torch_function__
            else:
                c.__torch_function__ = tf


def test_full_state_dicts_and_expert_stacks_on_the_211_route(tmp_path):
    """The full state dict gathered empty tensors for matrices a rank does not own on 2.11 (12
    of 12 such keys at W=2), and out-of-place foreach results lost their stacks' rows."""
    from experts.test_clients import foreach_out_of_place_and_scalars
    from placement.test_owned_tensors import consumers_check

    pool = get_pool(2)
    for r in pool.run(on_the_211_route, consumers_check, str(tmp_path), timeout=120):
        assert r["n_owned"] > 0 and r["full_tensor"] and r["grad_full_tensor"] <= 1e-6, r
        assert r["full_sd"] and r["torch_save_roundtrip"] and r["adamw_state_full"], r
    for same, scaled, refused in pool.run(on_the_211_route, foreach_out_of_place_and_scalars, timeout=120):
        assert all(same) and scaled
        assert "mixes an expert stack (rows" in refused, refused
