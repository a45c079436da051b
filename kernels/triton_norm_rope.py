"""Triton twins of ``norm_rope_ref``: fused RMSNorm (+ residual add) and neox-style rotary embedding.

Both round intermediates to the dtypes the reference's torch ops produce (the residual sum in the
input dtype, the normalised row cast back before the weight, each rotary product in the input dtype),
so bf16/fp16 results agree with the reference to the last bit up to fp32 summation order. Outputs are
new tensors, as in the reference; inputs may be strided views (for example slices of a fused QKV).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_dtype, check_launchable, next_pow2, num_warps_for


@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    hidden, eps,
    stride_out_t, stride_res_out_t, stride_x_t, stride_res_t,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + token * stride_x_t + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + token * stride_res_t + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(residual_out_ptr.dtype.element_ty)  # the reference adds in the input dtype
        tl.store(residual_out_ptr + token * stride_res_out_t + cols, summed, mask=mask)
        x = summed.to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)).to(residual_out_ptr.dtype.element_ty)
    else:
        normed = (x * tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(out_ptr.dtype.element_ty)
    out = weight.to(tl.float32) * normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_out_t + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Return ``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
    hidden = x.shape[-1]
    lead_shape = x.shape[:-1]
    x2 = _rows(x)  # [num_tokens, hidden]
    summed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, summed_dtype)
    out = torch.empty((x2.shape[0], hidden), dtype=out_dtype, device=x.device)
    residual_out = out if residual is None else torch.empty((x2.shape[0], hidden), dtype=summed_dtype,
                                                            device=x.device)
    res2 = x2 if residual is None else _rows(residual.expand_as(x))
    if x2.shape[0] > 0:
        check_launchable(_rms_norm_kernel, x2, res2, weight)
        for name, t in (("x", x2), ("residual", res2), ("weight", weight)):
            check_dtype(name, t)
        weight = weight.contiguous()
        block = next_pow2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            out, residual_out, x2, res2, weight,
            hidden, float(eps),
            out.stride(0), residual_out.stride(0), x2.stride(0), res2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block),
        )
    out = out.view(*lead_shape, hidden)
    return out if residual is None else (out, residual_out.view(*lead_shape, hidden))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, hidden] view with unit stride along hidden (copying only when unavoidable)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, num_heads, stride_src_t, stride_src_h, stride_src_d,
                  stride_dst_t, stride_dst_h, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (dims < HALF)
    src = src_ptr + token * stride_src_t + heads * stride_src_h
    x1 = tl.load(src + dims * stride_src_d, mask=mask, other=0.0)
    x2 = tl.load(src + (dims + HALF) * stride_src_d, mask=mask, other=0.0)
    ty = x1.dtype
    # Each product rounds to the input dtype before the sum, as torch's x * cos + rotate(x) * sin does.
    c = cos.to(ty).to(tl.float32)
    s = sin.to(ty).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    out1 = (x1 * c).to(ty).to(tl.float32) + (-x2 * s).to(ty).to(tl.float32)
    out2 = (x2 * c).to(ty).to(tl.float32) + (x1 * s).to(ty).to(tl.float32)
    dst = dst_ptr + token * stride_dst_t + heads * stride_dst_h
    tl.store(dst + dims, out1.to(ty), mask=mask)
    tl.store(dst + dims + HALF, out2.to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr, k_out_ptr, q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    num_q_heads, num_kv_heads,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h, stride_cs_p,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    cos = tl.load(cos_sin_ptr + position * stride_cs_p + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs_p + HALF + dims, mask=dims < HALF, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, token, num_q_heads, stride_q_t, stride_q_h, stride_q_d,
                  stride_qo_t, stride_qo_h, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, num_kv_heads, stride_k_t, stride_k_h, stride_k_d,
                  stride_ko_t, stride_ko_h, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] (cos | sin halves)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding over the whole head dim, as in HF Llama."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[2] != head_dim or cos_sin_cache.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(f"apply_rotary: query {tuple(query.shape)}, key {tuple(key.shape)} and cos_sin_cache "
                         f"{tuple(cos_sin_cache.shape)} need one even head_dim")
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    check_launchable(_rotary_kernel, query, key, positions, cos_sin_cache)
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_dtype(name, t)
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    half = head_dim // 2
    block_hq, block_hk, block_half = next_pow2(num_q_heads), next_pow2(num_kv_heads), next_pow2(half)
    _rotary_kernel[(num_tokens,)](
        q_out, k_out, query, key, positions, cos_sin_cache,
        num_q_heads, num_kv_heads,
        *query.stride(), *key.stride(), *q_out.stride()[:2], *k_out.stride()[:2], cos_sin_cache.stride(0),
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        num_warps=num_warps_for(block_hq * block_half * 2),
    )
    return q_out, k_out
