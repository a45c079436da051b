"""The native CPU kernels module (``kernels._cpu_ops``, built from ``kernels/native/`` by setup.py).

``ops`` is None where it could not be built (no C compiler) or ``TANDEM_NATIVE_KERNELS=0`` turns it
off; the CPU kernel set then runs the torch references, with the same results. torch is imported
first on purpose: the module's OpenMP runtime is the ``libgomp.so.1`` torch has already loaded.
"""

from __future__ import annotations

import functools
import os

import torch  # noqa: F401  (before the extension: its OpenMP symbols resolve to torch's runtime)

ops = None
if os.environ.get("TANDEM_NATIVE_KERNELS", "1").lower() not in ("0", "false", "off", "no"):
    try:
        from kernels import _cpu_ops as ops
    except ImportError:  # built without a C compiler
        ops = None


def is_available() -> bool:
    return ops is not None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (``/proc/cpuinfo``: ``amx_bf16``, ``avx512_vnni``, ...); empty
    where they cannot be read. What the kernels choose a GEMM route by, where oneDNN's AMX kernels would win."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")),
                                  ()))
    except OSError:
        return frozenset()


def describe() -> str:
    """One line for logs and benchmark reports: which instruction set the native kernels run, the int8 GEMM (its
    packed-weight body, or ``torch._int_mm`` where the CPU has no VNNI) and the MoE expert GEMM (its one-call body,
    or the per-expert oneDNN loop where the CPU has no AVX512-BF16)."""
    if ops is None:
        return "torch reference (native kernels not built)"
    return (f"native ({ops.isa()}, int8 GEMM {ops.int8_gemm_isa() or 'torch._int_mm'}, "
            f"MoE GEMM {ops.moe_gemm_isa() or 'per-expert oneDNN'})")
