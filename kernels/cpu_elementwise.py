"""RMSNorm (+ residual; Llama's and Gemma's offset one), rotary embedding, the KV store and SiLU * up (GELU-tanh * up
for Gemma, the clamped SwiGLU for gpt-oss's experts) on the CPU: the native kernels
(``kernels/native/elementwise_isa.h``) where they apply, else the torch references.

Each native op makes one pass over its rows where the references make several (a residual add, a
square, a mean, casts, products), and costs one call instead of a dozen torch ops: most of a small
decode step's time outside the GEMMs. Outputs are new tensors, as the references return; inputs are
never written.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels.activation_ref import silu_and_mul_ref
from kernels.gelu_and_mul_ref import gelu_tanh_and_mul_ref
from kernels.gpt_oss_moe_ref import clamped_swiglu_ref
from kernels.kv_store_ref import store_kv_ref
from kernels.norm_rope_ref import apply_rotary_ref, rms_norm_ref
from kernels.offset_rms_norm_ref import offset_rms_norm_ref

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _rows_ok(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one supported dtype whose last dim is contiguous."""
    dtype = tensors[0].dtype
    return cpu_native.ops is not None and dtype in _DTYPE_CODES and all(
        t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1 for t in tensors)


def rms_norm_cpu(x, weight, eps, residual=None):
    """``rms_norm_ref``'s contract: ``norm(x)``, or ``(norm(x + residual), x + residual)``."""
    out = _native_rms_norm(x, weight, eps, residual, offset_weight=False)
    return rms_norm_ref(x, weight, eps, residual) if out is None else out


def offset_rms_norm_cpu(x, weight, eps, residual=None):
    """``offset_rms_norm_ref``'s contract (Gemma's norm, scaled by ``1 + weight`` in fp32)."""
    out = _native_rms_norm(x, weight, eps, residual, offset_weight=True)
    return offset_rms_norm_ref(x, weight, eps, residual) if out is None else out


def _native_rms_norm(x, weight, eps, residual, offset_weight: bool):
    """The native kernel's result, or None where it does not take these inputs."""
    is_native = (x.dim() == 2 and _rows_ok(x, weight) and weight.is_contiguous()
                 and (residual is None or (_rows_ok(x, residual) and residual.shape == x.shape)))
    if not is_native:
        return None
    num_rows, hidden = x.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype)
    summed = torch.empty((num_rows, hidden), dtype=x.dtype) if residual is not None else None
    cpu_native.ops.rms_norm(
        x.data_ptr(), weight.data_ptr(), 0 if residual is None else residual.data_ptr(),
        0 if summed is None else summed.data_ptr(), out.data_ptr(), num_rows, x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), hidden, _DTYPE_CODES[x.dtype], float(eps),
        torch.get_num_threads(), offset_weight,
    )
    return out if residual is None else (out, summed)


def _heads_ok(t: torch.Tensor) -> bool:
    # [num_tokens, num_heads, head_dim], each token's heads contiguous (rows of a fused projection are fine)
    return t.dim() == 3 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def apply_rotary_cpu(query, key, positions, cos_sin_cache):
    """``apply_rotary_ref``'s contract: rotated copies of ``query`` and ``key``."""
    is_native = (_rows_ok(query, key) and _heads_ok(query) and _heads_ok(key) and query.shape[-1] % 2 == 0
                 and positions.dtype == torch.int64 and positions.is_contiguous()
                 and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous())
    if not is_native:
        return apply_rotary_ref(query, key, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    cpu_native.ops.rotary(
        query.data_ptr(), key.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), positions.data_ptr(),
        cos_sin_cache.data_ptr(), num_tokens, query.stride(0), key.stride(0), num_q_heads, key.shape[1], head_dim,
        _DTYPE_CODES[query.dtype], torch.get_num_threads(),
    )
    return q_out, k_out


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping):
    """``store_kv_ref``'s contract: row t of key/value into slot ``slot_mapping[t]`` (-1: skipped)."""
    is_native = (_rows_ok(key, value, k_cache, v_cache) and _heads_ok(key) and _heads_ok(value)
                 and k_cache.dim() == 4 and v_cache.dim() == 4
                 and k_cache.stride(-2) == k_cache.shape[-1] and v_cache.stride(-2) == v_cache.shape[-1]
                 and tuple(key.shape[1:]) == tuple(k_cache.shape[2:]) == tuple(value.shape[1:])
                 and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())
    if not is_native:
        return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    size = key.element_size()
    cpu_native.ops.store_kv(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        key.shape[0], key.stride(0) * size, value.stride(0) * size, k_cache.stride(0) * size, k_cache.stride(1) * size,
        v_cache.stride(0) * size, v_cache.stride(1) * size, k_cache.shape[1], key.shape[1] * key.shape[2] * size,
    )


_SILU, _GELU_TANH, _CLAMPED_SWIGLU = 0, 1, 2  # the native kernel's activation codes


def silu_and_mul_cpu(x):
    """``silu_and_mul_ref``'s contract: SiLU of the first half of each row times its second half."""
    out = _native_gated_activation(x, _SILU)
    return silu_and_mul_ref(x) if out is None else out


def gelu_tanh_and_mul_cpu(x):
    """``gelu_tanh_and_mul_ref``'s contract: GELU-tanh of the first half of each row times its second half."""
    out = _native_gated_activation(x, _GELU_TANH)
    return gelu_tanh_and_mul_ref(x) if out is None else out


def clamped_swiglu_cpu(x, alpha: float, limit: float):
    """``clamped_swiglu_ref``'s contract: gpt-oss's clamped SwiGLU of each row's gate half and up half."""
    out = _native_gated_activation(x, _CLAMPED_SWIGLU, alpha, limit)
    return clamped_swiglu_ref(x, alpha, limit) if out is None else out


def _native_gated_activation(x, activation: int, alpha: float = 0.0, limit: float = 0.0):
    if not (x.dim() == 2 and _rows_ok(x) and x.shape[-1] % 2 == 0):
        return None
    num_rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=x.dtype)
    cpu_native.ops.silu_and_mul(x.data_ptr(), out.data_ptr(), num_rows, x.stride(0), out.stride(0), width,
                                _DTYPE_CODES[x.dtype], torch.get_num_threads(), activation, alpha, limit)
    return out
