"""Kernels of the hot path, behind one switch: ``kernel_backend`` = "torch" | "cpu" | "triton" | "auto".

Every kernel has a pure-torch reference beside it, the test oracle: "torch" is the references alone,
"cpu" the native CPU kernels (``kernels/native``, built by setup.py) with the references for the rest,
"triton" the GPU kernels. ``load_kernels`` returns the set a model runner calls, so no caller branches
on backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels.activation_ref import silu_and_mul_ref
from kernels.gpt_oss_moe_ref import clamped_swiglu_moe_ref, clamped_swiglu_ref
from kernels.gelu_and_mul_ref import gelu_tanh_and_mul_ref
from kernels.kv_pack_ref import pack_kv_blocks_ref, unpack_kv_blocks_ref
from kernels.kv_store_ref import store_kv_ref
from kernels.mla_attention_ref import mla_attention_ref, store_latent_ref
from kernels.moe_ref import combine_grouped_rows, fused_moe_ref
from kernels.norm_rope_ref import apply_rotary_ref, rms_norm_ref
from kernels.offset_rms_norm_ref import offset_rms_norm_ref
from kernels.paged_attention_ref import paged_attention_ref

BACKENDS = ("torch", "cpu", "triton", "auto")


@dataclass(frozen=True)
class Kernels:
    name: str
    store_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    apply_rotary: Callable
    pack_kv_blocks: Callable
    unpack_kv_blocks: Callable
    silu_and_mul: Callable
    # fused_moe(hidden, gate_up, down, topk_weights, topk_ids): a mixture-of-experts MLP's experts over
    # tokens grouped by expert (kernels/moe_ref.py)
    fused_moe: Callable
    # offset_rms_norm(x, weight, eps, residual=None): Gemma's RMSNorm, scaled by 1 + weight in fp32
    # (kernels/offset_rms_norm_ref.py)
    offset_rms_norm: Callable
    # gelu_tanh_and_mul(gate_up): GELU-tanh(gate) * up, the GELU-gated MLP's activation (Gemma)
    gelu_tanh_and_mul: Callable
    # prepare_model(model, prepack_weights): one-time model preparation after its weights are loaded
    # (the CPU set gives each linear layer its GEMM, kernels/cpu_gemm.py); a no-op elsewhere
    prepare_model: Callable = lambda model, prepack_weights=True: None
    # clamped_swiglu_moe(hidden, gate_up, gate_up_bias, down, down_bias, topk_weights, topk_ids, alpha, limit):
    # gpt-oss's experts (biased, clamped SwiGLU) grouped by expert; the torch reference in every set so far
    # (kernels/gpt_oss_moe_ref.py)
    clamped_swiglu_moe: Callable = clamped_swiglu_moe_ref
    # clamped_swiglu(gate_up, alpha, limit): gpt-oss's expert activation of gate/up rows, for the sets whose experts
    # run as grouped GEMMs with the activation between them (the CPU's; kernels/gpt_oss_moe_ref.py)
    clamped_swiglu: Callable = clamped_swiglu_ref
    # store_latent(latent, latent_cache, slot_mapping) and mla_attention(query, latent_cache, cu_seqlens_q,
    # context_lens, block_tables, scale, kv_lora_rank): multi-head latent attention's cache write and absorbed
    # attention over the latent rows (kernels/mla_attention_ref.py); the references unless a set has its own
    store_latent: Callable = store_latent_ref
    mla_attention: Callable = mla_attention_ref
    # combine_grouped_rows(grouped_out, order, topk_weights, dtype): a mixture-of-experts layer's rows, still
    # grouped by expert, weighted and summed into their tokens (kernels/moe_ref.py)
    combine_grouped_rows: Callable = combine_grouped_rows


TORCH_KERNELS = Kernels(
    name="torch",
    store_kv=store_kv_ref,
    paged_attention=paged_attention_ref,
    rms_norm=rms_norm_ref,
    apply_rotary=apply_rotary_ref,
    pack_kv_blocks=pack_kv_blocks_ref,
    unpack_kv_blocks=unpack_kv_blocks_ref,
    silu_and_mul=silu_and_mul_ref,
    fused_moe=fused_moe_ref,
    offset_rms_norm=offset_rms_norm_ref,
    gelu_tanh_and_mul=gelu_tanh_and_mul_ref,
)


def resolve_backend(name: str, device: str) -> str:
    """'auto' means triton on CUDA and the CPU set elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend: must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "cpu"
    return name


def load_kernels(name: str, device: str = "cpu", model_dtype=None, latent_attention: bool = False) -> Kernels:
    """The kernel set ``name`` for ``device``; ``model_dtype`` and ``latent_attention`` only make the CPU set's
    name say what such a model runs (native kernels or references)."""
    backend = resolve_backend(name, device)
    if backend == "torch":
        return TORCH_KERNELS
    if backend == "cpu":
        from kernels.cpu_backend import cpu_kernels

        return cpu_kernels(TORCH_KERNELS, model_dtype, latent_attention)
    from kernels.triton_backend import TRITON_KERNELS  # imported lazily: triton is optional on CPU

    if not str(device).startswith("cuda"):
        from kernels.triton_common import is_interpreted
        from kernels.triton_kv_store import _store_kv_kernel

        if not is_interpreted(_store_kv_kernel):  # else every request would fail at its first kernel launch
            raise ValueError(f"kernel_backend: 'triton' runs compiled kernels on a CUDA device, and this device is "
                             f"{device}; use 'cpu' (the native CPU kernels) or 'torch' here, or set "
                             "TRITON_INTERPRET=1 before start to run the triton kernels in triton's interpreter "
                             "(slow: for testing them)")
    return TRITON_KERNELS
