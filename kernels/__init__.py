"""Kernels of the hot path, behind one switch: ``kernel_backend`` = "torch" | "triton" | "auto".

Every triton kernel has a pure-torch reference beside it; the references are the CPU path and the
test oracle. ``load_kernels`` returns the set a model runner calls, so no caller branches on backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels.kv_pack_ref import pack_kv_blocks_ref, unpack_kv_blocks_ref
from kernels.kv_store_ref import store_kv_ref
from kernels.norm_rope_ref import apply_rotary_ref, rms_norm_ref
from kernels.paged_attention_ref import paged_attention_ref

BACKENDS = ("torch", "triton", "auto")


@dataclass(frozen=True)
class Kernels:
    name: str
    store_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    apply_rotary: Callable
    pack_kv_blocks: Callable
    unpack_kv_blocks: Callable


TORCH_KERNELS = Kernels(
    name="torch",
    store_kv=store_kv_ref,
    paged_attention=paged_attention_ref,
    rms_norm=rms_norm_ref,
    apply_rotary=apply_rotary_ref,
    pack_kv_blocks=pack_kv_blocks_ref,
    unpack_kv_blocks=unpack_kv_blocks_ref,
)


def resolve_backend(name: str, device: str) -> str:
    """'auto' means triton on CUDA and torch elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend: must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    return name


def load_kernels(name: str, device: str = "cpu") -> Kernels:
    backend = resolve_backend(name, device)
    if backend == "torch":
        return TORCH_KERNELS
    from kernels.triton_backend import TRITON_KERNELS  # imported lazily: triton is optional on CPU

    return TRITON_KERNELS
