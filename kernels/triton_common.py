"""Helpers shared by the triton kernels: launch checks, block-size rounding, dot precision.

Whether a ``@triton.jit`` kernel runs compiled or under the CPU interpreter is decided when its module
is imported (``TRITON_INTERPRET=1`` must already be set then), so the wrappers check the pairing of
tensor device and kernel mode up front and fail with a message instead of a segfault.
"""

from __future__ import annotations

import torch
import triton

try:  # the interpreter's function class; its import path is internal, so probe it defensively
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - layout of another triton release
    InterpretedFunction = ()


def is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """CPU tensors need the interpreter; the compiled path needs CUDA tensors on one device."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"triton kernels: all tensors must be on one device (got {sorted(map(str, devices))})")
    (device,) = devices
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"triton kernels got {device.type} tensors but are compiled for the GPU; set TRITON_INTERPRET=1 "
            "before kernels.triton_* is first imported to run them on CPU, or use kernel_backend='torch'"
        )


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 dots would default to tf32 on tensor cores (~1e-3 error) where the reference is exact
    fp32; half-precision dots keep the backend's default (None)."""
    return "ieee" if dtype == torch.float32 else None


def num_warps_for(block_elems: int) -> int:
    """Warps for a program that touches ``block_elems`` elements at once: 4 to 16."""
    return int(min(16, max(4, block_elems // 1024)))


# Element types the kernels accept, for clear errors before launch.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtype {tensor.dtype} is not supported by the triton kernels "
                        f"(use one of {', '.join(map(str, SUPPORTED_DTYPES))})")


__all__ = ["check_launchable", "check_dtype", "dot_precision", "is_interpreted", "next_pow2",
           "num_warps_for"]
