"""Tensor parallelism: one model split across ``tensor_parallel_size`` rank processes (docs/tensor-parallel.md).

``shard_spec`` says which slice of each checkpoint tensor a rank holds, ``model`` is a rank's shard
and its collectives, ``ranks`` starts and drives the child ranks. ``load_tensor_parallel_model`` is
what the engine calls instead of ``weights.load_model`` when ``tensor_parallel_size`` > 1; with the
default of 1 nothing here is imported.
"""

from __future__ import annotations

import torch

from pipeline.parallel.shard_spec import TensorParallelError, UnsupportedTensorParallel

__all__ = ["TensorParallelError", "UnsupportedTensorParallel", "check_tensor_parallel_setup",
           "load_tensor_parallel_model"]


def check_tensor_parallel_setup(config, role, size: int, model_path: str):
    """``UnsupportedTensorParallel`` naming what a ``role`` worker of ``size`` ranks cannot run with ``config`` (the
    checkpoint at ``model_path``, speculative decoding); returns the checkpoint's ``hf_config``. Reads the config
    files only: the engine calls it before it starts any rank, a launcher before it starts any process."""
    from pipeline.config import PipelineRole
    from pipeline.parallel.shard_spec import check_checkpoint
    from pipeline.weights import load_hf_config

    if config.is_speculative and config.draft_model.model_path is None:
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={size} with speculative decoding needs a draft checkpoint "
            "(draft_model.model_path): the target cannot draft for itself across its ranks")
    if config.is_speculative and role is not PipelineRole.PrefillAndDecode:
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={size} with speculative decoding runs on colocated workers only: a {role.value} "
            "worker ships the draft's KV with the target's, and the draft is not split across the ranks")
    hf_config = load_hf_config(model_path)
    check_checkpoint(model_path, hf_config, size, config.model.quantization)
    return hf_config


def load_tensor_parallel_model(config, model_path: str, dtype: torch.dtype, device: str):
    """Start ranks 1..N-1, build rank 0's shard here; returns ``(model, hf_config)`` like ``weights.load_model``.

    The model is rank 0's shard (``model.load_shard``: ``TensorParallelLlama``, or ``TensorParallelLlamaMoe`` for
    Qwen3-MoE and Mixtral); ``model.driver`` is the ``RankGroup`` (close it to stop
    the other ranks; it is also closed when garbage-collected and at exit). A collective that waits longer than
    ``config.tensor_parallel_timeout_s`` for a rank (stuck or gone) raises instead of hanging. Refuses, with
    ``UnsupportedTensorParallel`` naming it, whatever tensor parallelism does not run (``check_tensor_parallel_setup``),
    before any rank starts.
    """
    from pipeline.cpu_placement import rank_placement
    from pipeline.parallel.model import Collectives, load_shard
    from pipeline.parallel.ranks import STARTUP_TIMEOUT_S, RankGroup, rank_device

    size = config.tensor_parallel_size
    if str(device).startswith("cuda") and torch.cuda.device_count() < size:
        raise UnsupportedTensorParallel(f"tensor_parallel_size={size} needs {size} GPUs; "
                                        f"{torch.cuda.device_count()} visible")
    hf_config = check_tensor_parallel_setup(config, config.pipeline_role, size, model_path)
    timeout_s = config.tensor_parallel_timeout_s
    placements = [rank_placement(config, rank) for rank in range(1, size)]  # each child's cores and threads
    group = RankGroup(size, model_path, dtype, device, config.kernel_backend, config.model.cpu_weight_prepack,
                      timeout_s, placements, keep_freed_memory=config.cpu_keep_freed_memory,
                      quantization=config.model.quantization)
    try:
        collectives = group.join_group(
            lambda: Collectives(group.store, 0, size, rank_device(device, 0), timeout_s, STARTUP_TIMEOUT_S))
        collectives.on_failure = group.name_the_dead_rank
        model = load_shard(hf_config, model_path, dtype, rank_device(device, 0), collectives, driver=group,
                           quantization=config.model.quantization)
        group.wait_ready()
    except BaseException:
        group.close()
        raise
    return model, hf_config
