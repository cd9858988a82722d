"""Run a torchtitan 0.3 Trainer with matrixfsdp on CPU: the ``qwen3_cpu_muon`` config of
recipes/titan_configs.py (a tiny Qwen3 on the stdlib's source, byte tokens, gloo).

    torchrun --nproc-per-node 2 recipes/titan_cpu.py                      # 100 steps, ~1-2 min
    torchrun --nproc-per-node 2 recipes/titan_cpu.py --training.steps 20  # any torchtitan option
    torchrun --nproc-per-node 2 recipes/titan_cpu.py --config qwen3_moe_cpu_muon   # mixture of experts
    torchrun --nproc-per-node 2 recipes/titan_cpu.py --config qwen3_moe_cpu_muon \
        --parallelism.expert_parallel_degree 2                            # torchtitan's expert parallelism
    torchrun --nproc-per-node 4 recipes/titan_cpu.py --parallelism.pipeline_parallel_degree 2  # PP=2 x DP=2

Pipeline parallelism needs a torch whose schedules take ``PipelineSchedule.step(arg_mbs=...)``, which
torchtitan 0.3 calls (2.15 does, 2.13 does not: ``parallelize_matrixfsdp`` then refuses PP) and uses torchtitan's defaults (1F1B,
microbatches of 1 row: 4 per data-parallel rank, 2 accumulation steps for the global 16 rows).
Each stage initializes from the same seed, so the parameters differ from a non-pipelined run's;
to compare with the plain W=2 run start both from one seed checkpoint, as torchtitan advises::

    torchrun --nproc-per-node 1 recipes/titan_cpu.py --checkpoint.enable --checkpoint.create_seed_checkpoint \
        --parallelism.data_parallel_shard_degree 1 --dump-folder runs/seed
    torchrun --nproc-per-node 4 recipes/titan_cpu.py --parallelism.pipeline_parallel_degree 2 \
        --checkpoint.enable --checkpoint.initial_load_path runs/seed/checkpoint/step-0

torchtitan 0.3 assumes an accelerator; on a CPU-only machine it needs three shims, applied here
before the Trainer is built (nothing else is patched; matrixfsdp.titan already initializes
parameters on full tensors and swaps torchtitan's chunked loss):

1. ``torchtitan.tools.utils.device_type`` is ``"cuda"`` when no accelerator is found, and every
   torchtitan module copied it at import: set to ``"cpu"`` / ``torch.cpu`` in each of them;
2. ``build_device_memory_monitor`` reads CUDA memory statistics: replaced by a zero monitor;
3. ``set_pg_timeouts`` calls ``torch.cpu.synchronize`` and a device barrier: made a no-op.

``import torchtitan.trainer`` also imports ``triton`` (CUDA expert-parallel kernels a dense run
never calls): the ``[titan]`` extra installs it (``pip install -c constraints.txt -e ".[titan]"``).
Outputs: torchtitan's log on stdout (loss every 10 steps) and its files under runs/titan_cpu/.
"""

import os
import sys

import torch


class _ZeroMemoryMonitor:
    device_name, device_index, device_capacity, device_capacity_gib = "cpu", 0, 0, 0.0

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats
        return DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self):
        pass


def install_cpu_shims() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils
    import torchtitan.trainer  # noqa: F401  (imports every module that copies device_type)

    if utils.device_type != "cpu":  # (1)
        old_type, old_module = utils.device_type, utils.device_module
        for name, mod in list(sys.modules.items()):
            if mod is not None and (name == "torchtitan" or name.startswith("torchtitan.")):
                if getattr(mod, "device_type", None) == old_type:
                    mod.device_type = "cpu"
                if getattr(mod, "device_module", None) is old_module:
                    mod.device_module = torch.cpu
    metrics.build_device_memory_monitor = _ZeroMemoryMonitor  # (2)
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None  # (3)


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        sys.exit("error: run under torchrun: torchrun --nproc-per-node 2 recipes/titan_cpu.py")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    install_cpu_shims()
    given = any(a == "--config" or a.startswith("--config=") for a in sys.argv[1:])
    sys.argv[1:1] = ["--module", "titan_configs"] + ([] if given else ["--config", "qwen3_cpu_muon"])  # this folder is on sys.path
    from torchtitan.train import main

    main()  # trains, closes the trainer, destroys the process group
    # torch 2.13 + gloo: a worker thread may still be releasing the last collective's tensors when
    # the interpreter shuts down, which aborts the process (SIGABRT); skip the shutdown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
