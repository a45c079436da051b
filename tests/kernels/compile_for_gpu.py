"""Compile every triton kernel ahead of time for an NVIDIA target, no GPU needed (ptxas ships with triton).

The interpreter accepts code the GPU compiler rejects (types of loop-carried values, scalar masks,
dot shapes), so the CPU test run also compiles each kernel in the configurations the wrappers launch.
Run as ``TRITON_INTERPRET=0 python -m tests.kernels.compile_for_gpu [arch]``; prints one line per kernel.
"""

from __future__ import annotations

import os
import sys


def main(arch: int = 90) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise SystemExit("compile_for_gpu: run with TRITON_INTERPRET=0 (interpreted kernels cannot be compiled)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_kv_pack, triton_kv_store, triton_norm_rope, triton_paged_attention

    target = GPUTarget("cuda", arch, 32)

    def compile_kernel(kernel, pointers: dict, constexprs: dict, floats=(), num_warps=4):
        signature = {name: "constexpr" if name in constexprs else pointers.get(name) or
                     ("fp32" if name in floats else "i32") for name in kernel.arg_names}
        triton.compile(ASTSource(kernel, signature, constexprs), target=target, options={"num_warps": num_warps})
        print(f"compiled {kernel.fn.__name__} {constexprs}", flush=True)

    for dt, precision in (("bf16", None), ("fp32", "ieee")):
        # (BLOCK_Q, BLOCK_M, BLOCK_N, NUM_SPLITS, USE_WINDOW, GROUP, HEAD_DIM): decode, prefill, split, odd
        for block_q, block_m, block_n, splits, window, group, head_dim in (
            (1, 16, 64, 1, False, 4, 128), (16, 64, 64, 1, True, 4, 128), (1, 16, 64, 4, False, 4, 128),
            (21, 64, 32, 2, True, 3, 48),
        ):
            if dt == "fp32" and block_q == 21:
                continue
            out = "*fp32" if splits > 1 else f"*{dt}"
            pointers = dict(out_ptr=out, lse_ptr=out, query_ptr=f"*{dt}", k_cache_ptr=f"*{dt}",
                            v_cache_ptr=f"*{dt}", cu_seqlens_q_ptr="*i32", context_lens_ptr="*i32",
                            block_tables_ptr="*i32")
            compile_kernel(triton_paged_attention._paged_attention_kernel, pointers, dict(
                GROUP=group, PAGE_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, USE_WINDOW=window,
                DOT_PRECISION=precision, DOTS_IN_FP32=dt == "fp32"), floats=("scale_log2",))
        if dt == "fp32":
            break  # the remaining kernels have no dtype-dependent code paths
        compile_kernel(triton_paged_attention._reduce_splits_kernel,
                       dict(out_ptr=f"*{dt}", partial_ptr="*fp32", lse_ptr="*fp32"),
                       dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=4))
        compile_kernel(triton_kv_store._store_kv_kernel,
                       dict(key_ptr=f"*{dt}", value_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}",
                            slot_mapping_ptr="*i64"),
                       dict(PAGE_SIZE=16, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
        for has_residual in (False, True):
            compile_kernel(triton_norm_rope._rms_norm_kernel,
                           dict(out_ptr=f"*{dt}", residual_out_ptr=f"*{dt}", x_ptr=f"*{dt}", residual_ptr=f"*{dt}",
                                weight_ptr="*fp32"),
                           dict(HAS_RESIDUAL=has_residual, BLOCK=4096), floats=("eps",))
        compile_kernel(triton_norm_rope._rotary_kernel,
                       dict(q_out_ptr=f"*{dt}", k_out_ptr=f"*{dt}", q_ptr=f"*{dt}", k_ptr=f"*{dt}",
                            positions_ptr="*i64", cos_sin_ptr="*fp32"),
                       dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64))
        for to_buffer in (True, False):
            for flat in (True, False):
                compile_kernel(triton_kv_pack._copy_blocks_kernel,
                               dict(cache_ptr=f"*{dt}", buffer_ptr=f"*{dt}", block_ids_ptr="*i64"),
                               dict(TO_BUFFER=to_buffer, FLAT_INNER=flat, BLOCK=4096))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
