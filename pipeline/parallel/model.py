"""One rank's shard of a Llama-family model (dense or mixture-of-experts), and the collectives that join the shards.

The shard is the unchanged model class (``LlamaFamilyForCausalLM``; ``LlamaMoeFamilyForCausalLM`` for Qwen3-MoE
and Mixtral; ``GptOssForCausalLM``) built from the rank's config (``ShardSpec.rank_config``: its heads, its MLP
and expert columns, its vocabulary rows) with three additions: an all-reduce after each row-parallel part
(o_proj, and the whole MLP of every layer, dense or sparse: once per layer), a vocabulary-parallel embedding
(masked lookup + all-reduce), and logits gathered from every rank's vocabulary rows. A quantized checkpoint's
layers are swapped in at load as in a single-process model, on the rank's sizes. On rank 0 each
``forward`` and ``compute_logits`` first tells the other ranks to do the same (``driver``), so they run in
lockstep. ``load_shard`` picks the shard class for a config and loads the rank's slices into it; every rank
builds its shard through it. The experts are stacked at load and packed by the kernel set
(``kernels.cpu_backend.prepare_model_cpu``) exactly as in a single-process model: only their sizes differ.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.checkpoint_files import read_config_json
from pipeline.models.deepseek_v3 import DeepseekV3ForCausalLM
from pipeline.models.gemma3 import Gemma3ForCausalLM
from pipeline.models.gpt_oss import GptOssForCausalLM
from pipeline.models.layers import empty_parameter
from pipeline.models.llama import LlamaFamilyForCausalLM
from pipeline.models.llama_moe import LlamaMoeFamilyForCausalLM
from pipeline.models.registry import resolve_model_class
from pipeline.parallel.shard_spec import ShardSpec, TensorParallelError, UnsupportedTensorParallel, read_shards
from pipeline.quantization.config import quantization_spec
from pipeline.weights import load_checkpoint_weights


class Collectives:
    """The rank's ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA), its own rather than the
    global default group, so several tensor-parallel models can live in one process one after another."""

    def __init__(self, store, rank: int, size: int, device: torch.device, timeout_s: float, setup_timeout_s: float):
        """``timeout_s`` bounds each collective's wait (``tensor_parallel_timeout_s``); ``setup_timeout_s`` the
        group's own (its rendezvous waits for every rank, which may still be importing torch and loading)."""
        import torch.distributed as dist

        self.timeout = datetime.timedelta(seconds=timeout_s)
        setup_timeout = datetime.timedelta(seconds=max(timeout_s, setup_timeout_s))
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = setup_timeout
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = setup_timeout
            # the ranks are this host's processes: their connections on loopback, never on the host's interfaces
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(store, rank, size, options)
        self.rank, self.size = rank, size
        # rank 0: called when a collective fails, before its error is raised (``RankGroup.name_the_dead_rank``: a
        # rank that died broke it, and the error names that rank and its exit code instead of gloo's reset)
        self.on_failure: Callable[[], None] | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        self._wait(self.group.allreduce([tensor]))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self.group.allgather([gathered], [tensor.contiguous()]))
        return gathered

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank, in place."""
        self._wait(self.group.broadcast(tensor, 0))
        return tensor

    def _wait(self, work) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # a peer that died (connection closed) or a collective past its timeout
            if self.on_failure is not None:
                self.on_failure()
            raise TensorParallelError(f"tensor-parallel collective failed on rank {self.rank}: {exc}") from exc


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding: ids outside them look up zeros, and the all-reduce fills them in; then the
    model's embedding scale, where it has one (Gemma's sqrt(hidden_size), in the model dtype)."""

    def __init__(self, spec: ShardSpec, hidden_size: int, dtype: torch.dtype, device, collectives: Collectives,
                 scale: torch.Tensor | None = None):
        super().__init__()
        # [vocab / tp, hidden]
        self.weight = empty_parameter(spec.vocab_per_rank, hidden_size, dtype=dtype, device=device)
        self.start = spec.rank * spec.vocab_per_rank
        self.collectives = collectives
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        local = input_ids - self.start
        is_here = (local >= 0) & (local < self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(~is_here, 0), self.weight)
        embedded.masked_fill_(~is_here.unsqueeze(-1), 0.0)
        embedded = self.collectives.all_reduce(embedded)
        return embedded if self.scale is None else embedded * self.scale


class TensorParallelShard:
    """What every shard class adds to its model class (it comes first in the bases): the collectives around
    the unchanged model. ``load_weights`` takes ``read_shards``' slices."""

    def __init__(self, hf_config, dtype: torch.dtype, device, spec: ShardSpec, collectives: Collectives,
                 driver=None):
        super().__init__(spec.rank_config(hf_config), dtype, device)
        self.full_vocab_size = spec.vocab_size
        self.collectives = collectives
        self.driver = driver  # rank 0: sends each step to the other ranks (pipeline.parallel.ranks.RankGroup)
        self.model.embed_tokens = VocabParallelEmbedding(spec, hf_config.hidden_size, dtype, device, collectives,
                                                         scale=getattr(self.model.embed_tokens, "scale", None))
        for layer in self.model.layers:  # row-parallel outputs are partial sums until reduced
            # attention's output is o_proj's (hooked on the attention, so a quantized o_proj swapped in at load
            # keeps it)
            layer.self_attn.register_forward_hook(self._reduce_output)
            # the MLP's output, dense (down_proj's) or sparse (the weighted sum of each token's experts, every
            # expert's partial down_proj product): one all-reduce per layer for either kind
            layer.mlp.register_forward_hook(self._reduce_output)

    def _reduce_output(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(output)

    def forward(self, batch, kv_cache: torch.Tensor, kernels) -> torch.Tensor:
        if self.driver is None:
            return super().forward(batch, kv_cache, kernels)
        self.driver.send_forward(batch, kv_cache.shape)
        return super().forward(batch, kv_cache, kernels)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` on rank 0 -> fp32 logits ``[n, vocab]`` from every rank's vocabulary rows (other ranks: their
        own rows of rank 0's ``hidden``, which they receive; the return value is meaningful on rank 0 only)."""
        if self.driver is not None:
            self.driver.send_logits(hidden.shape[0])
        hidden = self.collectives.broadcast(hidden.contiguous())
        local = super().compute_logits(hidden)  # [n, vocab / tp]
        return torch.cat(self.collectives.all_gather(local), dim=-1)[:, :self.full_vocab_size]


class TensorParallelLlama(TensorParallelShard, LlamaFamilyForCausalLM):
    """A rank's shard of a Llama/Mistral/Qwen2/Qwen3 model."""


class TensorParallelLlamaMoe(TensorParallelShard, LlamaMoeFamilyForCausalLM):
    """A rank's shard of a Qwen3-MoE/Mixtral model: every expert holds its slice of the intermediate dimension
    (stacked and packed by the kernel set like any model's experts), the router is replicated."""


class TensorParallelGptOss(TensorParallelShard, GptOssForCausalLM):
    """A rank's shard of a gpt-oss model: its q heads' attention sinks, every expert's slice of the intermediate
    dimension (the experts' down bias added on rank 0 only), the router replicated."""


class TensorParallelGemma3(TensorParallelShard, Gemma3ForCausalLM):
    """A rank's shard of a Gemma 3 text model: the Llama layout (its per-head q/k norms replicated), each
    attention and MLP output reduced before Gemma's post-norms, the embedding scaled after its all-reduce, the
    logits softcapped per vocabulary row before they are gathered."""


class TensorParallelDeepseekV3(TensorParallelShard, DeepseekV3ForCausalLM):
    """A rank's shard of a DeepSeek-V3 model: its heads' rows of the latent attention's q and ``kv_b_proj`` and their
    columns of ``o_proj``, the latent projections and the latent cache whole (every rank computes and caches the
    same latent rows), every routed expert's and the shared experts' slice of their intermediate dimension, the
    router replicated (vLLM's layout for MLA under TP)."""


# The model class a checkpoint resolves to (pipeline/models/registry.py) -> its shard class.
SHARD_CLASSES: dict[type, type[TensorParallelShard]] = {
    LlamaFamilyForCausalLM: TensorParallelLlama,
    LlamaMoeFamilyForCausalLM: TensorParallelLlamaMoe,
    GptOssForCausalLM: TensorParallelGptOss,
    DeepseekV3ForCausalLM: TensorParallelDeepseekV3,
    Gemma3ForCausalLM: TensorParallelGemma3,
}


def load_shard(hf_config, model_path: str, dtype: torch.dtype, device, collectives: Collectives,
               driver=None, quantization: str | None = None) -> TensorParallelShard:
    """Rank ``collectives.rank``'s shard of the checkpoint at ``model_path``, its slices loaded (quantized layers
    as the checkpoint or ``quantization`` says, as in a single-process model), in eval mode (every rank builds its
    shard here: rank 0 with its ``driver``)."""
    model_class = resolve_model_class(hf_config)
    if model_class not in SHARD_CLASSES:  # check_supported refuses these first, by architecture
        raise UnsupportedTensorParallel(f"no tensor-parallel shard of {model_class.__name__}")
    quantized = quantization_spec(read_config_json(model_path))
    spec = ShardSpec.of(hf_config, collectives.rank, collectives.size,
                        scale_block=None if quantized is None else quantized.block_size)
    model = SHARD_CLASSES[model_class](hf_config, dtype, device, spec, collectives, driver=driver)
    load_checkpoint_weights(model, model_path, read_shards(model_path, spec), quantization)
    return model.eval()
