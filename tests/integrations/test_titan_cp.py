"""matrixfsdp under torchtitan's context parallelism (``parallelism.context_parallel_degree``).

torchtitan folds the CP ranks into its ``"fsdp"`` mesh (``dp_shard * cp`` ranks); matrixfsdp
plans owners over that mesh and applies torchtitan's own CP forward wrapping to the attention, as
its stock ``parallelize_qwen3`` does. torchtitan's CP cannot compute attention on a CPU, with
either backend (torch 2.13 and 2.15):

* SDPA: the CP wrapper hands ``F.scaled_dot_product_attention`` sequence-sharded DTensors; on a
  CPU that dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, for which DTensor
  has no sharding strategy: ``NotImplementedError: Operator
  aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
  registered.`` (torch registers the ring-attention strategies for the CUDA flash, efficient and
  cuDNN kernels only);
* FlexAttention: ``NotImplementedError: FlexAttention does not support backward on CPU`` (it also
  needs the sequence divisible by ``cp * 128``).

So no CP step ran here. What is tested: at W=2 with ``cp=2`` (``dp_shard=1``) the model is
planned and sharded over the 2-rank ``"fsdp"`` mesh (both ranks own matrices), torchtitan's CP
wrapper is on every layer's attention, and the first step fails with torch's SDPA error above on
every rank (so this test tells when a torch release lifts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

# torchtitan.trainer, not torchtitan: 0.3 imports on torch 2.11 but its trainer does not (it needs
# torch.distributed.fsdp.DataParallelMeshDims, from 2.13 on)
pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                    reason="torchtitan is not installed, or its trainer does not import with this torch "
                           "(torchtitan 0.3 needs torch>=2.13; pip install -e '.[titan]')")

from _harness import get_pool  # noqa: E402
from _titan_cpu import SyntheticTokens  # noqa: E402

SDPA_CPU_ERROR = ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
                  "strategy registered")


class PositionTokens(SyntheticTokens):
    """:class:`SyntheticTokens` with the ``positions`` torchtitan's CP input sharding requires."""

    @dataclass(kw_only=True, slots=True)
    class Config(SyntheticTokens.Config):
        pass

    def __iter__(self):
        import torch

        for inputs, labels in super().__iter__():
            x = inputs["input"]
            yield {**inputs, "positions": torch.arange(x.shape[1]).expand_as(x).contiguous()}, labels


def _build_cp(folder: str) -> dict:
    """Pool worker (W=2): the tiny Qwen3 with ``context_parallel_degree=2`` through torchtitan's
    Trainer and with_matrixfsdp; inspect the sharded model, then try one step."""
    import torch
    import torch.distributed as dist

    from _titan_cpu import _snapshot_globals, cpu_patches, tiny_qwen3_config

    import matrixfsdp
    import matrixfsdp.titan as mt

    W = dist.get_world_size()
    cfg = tiny_qwen3_config(steps=1, global_batch=2, world_size=W // 2, dump_folder=folder)
    cfg.dataloader = PositionTokens.Config(seed=0, vocab_size=256)
    cfg.parallelism.context_parallel_degree = 2
    cfg = mt.with_matrixfsdp(cfg, optimizer="Muon", lr=0.02, adamw_lr=8e-4,
                             optimizer_kwargs={"ns_dtype": torch.float32})
    restore = _snapshot_globals()
    trainer = None
    try:
        with cpu_patches(full_tensor_init=False):
            trainer = cfg.build()
            dims = trainer.parallel_dims
            fsdp = dims.get_mesh("fsdp")
            model = trainer.model_parts[0]
            owners = {f: o.owner for f, p in model.named_parameters() if (o := matrixfsdp.owned_of(p)) is not None
                      and o.kind == "matrix"}
            dp_meshes = {tuple(o.mesh.mesh.flatten().tolist()) for p in model.parameters()
                         if (o := matrixfsdp.owned_of(p)) is not None}
            wrapped = [getattr(vars(layer.attention.inner_attention).get("forward"), "__name__", None) == "cp_forward"
                       for layer in model.layers.values()]
            error = None
            try:
                trainer.train()
            except NotImplementedError as e:
                error = str(e)
        return {"fsdp": (tuple(fsdp.mesh.flatten().tolist()), dims.dp_shard, dims.cp), "owners": owners,
                "dp_meshes": sorted(dp_meshes), "wrapped": wrapped, "error": error}
    finally:
        try:
            if trainer is not None:
                trainer.close()
        finally:
            restore()


def test_titan_cp_plans_over_fsdp_mesh_and_cpu_attention_is_refused_by_torch(tmp_path):
    res = get_pool(2).run(_build_cp, str(tmp_path), timeout=180)
    for r in res:
        assert r["fsdp"] == ((0, 1), 1, 2), r["fsdp"]  # "fsdp" = dp_shard (1) x cp (2)
        assert r["dp_meshes"] == [(0, 1)], r["dp_meshes"]  # owners planned over that mesh
        assert set(r["owners"].values()) == {0, 1}, r["owners"]  # both CP ranks own matrices
        assert r["wrapped"] and all(r["wrapped"]), r["wrapped"]  # torchtitan's CP wrapper applied
        assert r["error"] is not None and SDPA_CPU_ERROR in r["error"], r["error"]
    assert res[0]["owners"] == res[1]["owners"]
