"""The triton kernel set, one twin per torch reference, for ``load_kernels("triton")``.

Importing this module compiles nothing; each kernel is JIT-compiled on first launch. On a machine
without a GPU the kernels run only under ``TRITON_INTERPRET=1``, set before this module is imported.
"""

from __future__ import annotations

from kernels import Kernels
from kernels.activation_ref import silu_and_mul_ref
from kernels.gelu_and_mul_ref import gelu_tanh_and_mul_ref
from kernels.offset_rms_norm_ref import offset_rms_norm_ref
from kernels.triton_kv_pack import pack_kv_blocks_triton, unpack_kv_blocks_triton
from kernels.triton_kv_store import store_kv_triton
from kernels.triton_mla_attention import mla_attention_triton
from kernels.triton_moe import fused_moe_triton
from kernels.triton_norm_rope import apply_rotary_triton, rms_norm_triton
from kernels.triton_paged_attention import paged_attention_triton

TRITON_KERNELS = Kernels(
    name="triton",
    store_kv=store_kv_triton,
    paged_attention=paged_attention_triton,
    rms_norm=rms_norm_triton,
    apply_rotary=apply_rotary_triton,
    pack_kv_blocks=pack_kv_blocks_triton,
    unpack_kv_blocks=unpack_kv_blocks_triton,
    silu_and_mul=silu_and_mul_ref,  # one elementwise op torch already runs as one kernel on the GPU
    fused_moe=fused_moe_triton,
    # Gemma's ops run their torch references (a few elementwise kernels each on the GPU; no triton twin yet)
    offset_rms_norm=offset_rms_norm_ref,
    gelu_tanh_and_mul=gelu_tanh_and_mul_ref,
    mla_attention=mla_attention_triton,  # store_latent keeps its reference: one indexed copy on the GPU
)
