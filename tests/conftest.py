"""Suite-wide fixtures, and the torch-internals subset that CI runs on the other torch releases."""

from __future__ import annotations

import pytest
from _harness import close_pools

# [Note: the torch-internals subset]
# CI (.ci/run) runs the whole suite on the pinned torch (constraints.txt) and, on every other
# tested release (the GPU image's 2.11, the newest 2.15), only the tests marked `torch_internals`:
# those whose outcome depends on torch's internals rather than on matrixfsdp's own arithmetic.
# Entries are node-id prefixes (a folder, a file, a test, one parametrization); a test matching
# any of them gets the marker. Run the subset with `python -m pytest -q -m torch_internals`.
# A full-suite run fails on an entry that matches no test, so the list cannot rot silently.
TORCH_INTERNALS = (
    # checkpoints and full state dicts: DCP's planners and metadata unpickling, state_dict's
    # gathers, the version-checked full-state-dict loaders, stock FSDP2 interop, HF export
    "tests/checkpoint/test_full_state_load.py",
    "tests/checkpoint/test_hsdp_full_state.py",
    "tests/checkpoint/test_dcp.py::test_reshard_world",
    "tests/checkpoint/test_dcp.py::test_fsdp2_interop",
    "tests/checkpoint/test_dcp.py::test_export_import_roundtrip",
    "tests/checkpoint/test_dcp.py::test_torch_adamw_resume",
    "tests/checkpoint/test_untrusted.py::test_crafted_metadata_refused_in_one_process",
    "tests/checkpoint/test_untrusted.py::test_crafted_bytes_entry_runs_under_stock_dcp_load",
    "tests/checkpoint/test_untrusted.py::test_genuine_metadata_reads_as_torch_reads_it",
    "tests/checkpoint/test_experts.py::test_full_state_dicts_hold_whole_stacks",
    "tests/checkpoint/test_hsdp.py::test_hsdp_stock_fsdp2_interop",
    "tests/checkpoint/test_exit_safety.py::test_all_gather_strings",
    "tests/tp/test_stock_checkpoint.py",
    "tests/fully_shard/test_hsdp_tp.py::test_hsdp_tp_full_state_dict_roundtrip[split]",
    # compat paths: the release pin, DTensor subclass dispatch of owned tensors, the fake group
    "tests/test_layering.py::test_the_compat_module_pins_the_torch_versions_it_was_verified_on",
    "tests/placement/",
    "tests/comm/test_fake_backend.py",
    "tests/dryrun/test_shard_scaling.py",  # ATen call counts of sharding one rank, on the fake group
    "tests/comm/test_collectives.py::test_segment_collectives[3]",
    # torch.compile, and the CUDA paths built on the CPU (ATen call counts, streams and events)
    "tests/fully_shard/test_compile.py::test_compiled_step_under_sharding[fully_shard]",
    "tests/fully_shard/test_compile_model.py::test_compiled_model_matches_eager[fully_shard-blocks]",
    "tests/engine/test_gpu_paths.py",
    "tests/engine/test_event_waits.py",
    "tests/engine/test_bitwise_golden.py",
    "tests/bench/test_gpu_check.py::test_dry_run_of_the_cuda_path_on_the_cpu",
    # DTensor dispatch under TP (torch's parallelize_module plans, DTensor sharding propagation)
    "tests/tp/test_protocol.py",
    "tests/tp/test_hf_models.py::test_hf_qwen3_base_model_tp_plan_muon_parity",
    # torchtitan and Hugging Face (each skips where its package is absent). torchtitan's Trainer at
    # W = 1, 2, 3 is test_titan_moe's one-process parity (its attention matrices are owned as the
    # dense model's are; the dense model trains and reshards in the checkpoint test); per-block
    # inductor compiles are test_compile_model's fully_shard-blocks case
    "tests/integrations/test_titan.py::test_titan_checkpoint_resume_and_reshard[Muon]",
    "tests/integrations/test_titan.py::test_parallelize_rejects_unsupported_parallelism",
    "tests/integrations/test_titan_moe.py::test_titan_moe_matches_one_process",
    "tests/integrations/test_titan_pp.py",
    "tests/integrations/test_huggingface.py",
    "tests/integrations/test_hf_moe.py::test_hf_moe_training_parity",
    "tests/integrations/test_hf_moe.py::test_hf_moe_save_pretrained_roundtrip",
    "tests/integrations/test_hf_trainer.py::test_trainer_matches_plain_loop",
    "tests/integrations/test_hf_trainer.py::test_trainer_resume_is_exact[fully_shard]",
    # one parity run per front-end and mesh kind (autograd hooks, FSDP2 state, pipelining)
    "tests/fully_shard/test_parity.py::test_parity_10_steps[3]",
    "tests/fully_shard/test_dropin.py::test_dropin_matches_torch_fully_shard",
    "tests/fully_shard/test_hsdp.py::test_hsdp_parity_all_optimizers[split-2-2]",
    "tests/fully_shard/test_tp.py::test_fsdp_tp_parity_and_step_collectives[muon-2-2-80]",
    "tests/fully_shard/test_hsdp_tp.py::test_hsdp_tp_parity_and_step_collectives[split]",
    "tests/fully_shard/test_pipelining.py::test_pipelining_parity_and_step_collectives",
    "tests/fully_shard/test_autograd_uses.py",
    "tests/replicate/test_front_end.py::test_matches_ddp[2-2]",
    "tests/replicate/test_hsdp.py::test_matches_ddp_and_one_process[split-2-2]",
    "tests/experts/test_parity.py::test_moe_parity",
    "tests/optim/test_routing_invariant.py",
    # torch.optim.Muon's bf16 buffer aliasing: through 2.14 it normalizes the buffer, 2.15 copies
    "tests/optim/test_muon_bf16_buffer.py",
    # QK-clip: transformers' attention-function registry, and the rows each placement stores
    # (DTensor's local shapes and offsets) under TP with a TorchFunctionMode capture
    "tests/qk_clip/test_huggingface.py::test_qwen3_gqa_matches_the_reference[sdpa]",
    "tests/qk_clip/test_distributed.py::test_tensor_parallel[dp2xtp2]",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torch_internals: depends on torch's internals; CI runs these on every tested "
                   "release, the rest on the pinned one only ([Note: the torch-internals subset])")


_SKIPPED_MODULES: set[str] = set()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module skipped whole (its package absent): its entries cannot match
        _SKIPPED_MODULES.add(report.nodeid.split("::")[0])


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    used: set[str] = set()
    for item in items:
        hits = [p for p in TORCH_INTERNALS if _matches(item.nodeid, p)]
        if hits:
            item.add_marker(pytest.mark.torch_internals)
            used.update(hits)
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword:
        stale = [p for p in TORCH_INTERNALS if p not in used and p.split("::")[0] not in _SKIPPED_MODULES]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py TORCH_INTERNALS: entries matching no test: {stale}")


def _matches(nodeid: str, prefix: str) -> bool:
    """A node-id prefix matches at a boundary: a folder, a file, a test (all its parametrizations)."""
    if not nodeid.startswith(prefix):
        return False
    rest = nodeid[len(prefix):]
    return prefix.endswith("/") or rest == "" or rest[0] in ":["


@pytest.fixture(autouse=True, scope="module")
def _shared_pools_per_module():
    """Shared worker pools (``get_pool``) live for one test module, not the session.

    Every test makes process groups (meshes) that live as long as the worker; over the whole
    suite the long-lived workers reached ~600 gloo threads each and used CPU while idle, which
    made the tests after them up to 10x slower (the suite took 45 minutes instead of 15)."""
    yield
    close_pools()
