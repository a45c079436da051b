"""The native CPU kernels module (``kernels._cpu_ops``, built from ``kernels/native/`` by setup.py).

``ops`` is None where it could not be built (no C compiler) or ``TANDEM_NATIVE_KERNELS=0`` (false, off, no)
turns it off; the CPU kernel set then runs the torch references, with the same results. Any other value than
those and 1 (true, on, yes) is refused when a kernel set is loaded (``check_switch``), not taken for either.
torch is imported first on purpose: the module's OpenMP runtime is the ``libgomp.so.1`` torch has already loaded.
"""

from __future__ import annotations

import functools
import os

import torch  # before the extension: its OpenMP symbols resolve to torch's runtime

SWITCH_ENV = "TANDEM_NATIVE_KERNELS"
_OFF, _ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes")
_switch = os.environ.get(SWITCH_ENV, "1").strip().lower()
is_turned_off = _switch in _OFF

ops = None
if not is_turned_off:
    try:
        from kernels import _cpu_ops as ops
    except ImportError:  # built without a C compiler
        ops = None

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native kernels take; any other runs the references


def check_switch() -> None:
    """A ``TANDEM_NATIVE_KERNELS`` value that is neither on nor off is a configuration error."""
    if _switch not in _OFF + _ON:
        raise ValueError(f"{SWITCH_ENV}={os.environ.get(SWITCH_ENV)!r}: use 1 (native kernels, the default) or 0 "
                         "(the torch references)")


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


def describe(dtype: torch.dtype | None = None) -> str:
    """One line for logs and benchmark reports: which instruction set the native kernels run, the int8 GEMM (its
    packed-weight body, or ``torch._int_mm`` where the CPU has no VNNI) and the MoE expert GEMM (its one-call body,
    or the per-expert oneDNN loop where the CPU has no AVX512-BF16); or why the references run (for a model of
    ``dtype``, when given)."""
    if ops is None:
        why = f"turned off: {SWITCH_ENV}=0" if is_turned_off else "not built"
        return f"torch reference (native kernels {why})"
    if dtype is not None and dtype not in NATIVE_DTYPES:
        return (f"torch reference ({str(dtype).removeprefix('torch.')}: the native kernels and packed GEMMs take "
                "float32 and bfloat16; --dtype bfloat16 runs them)")
    return (f"native ({ops.isa()}, int8 GEMM {ops.int8_gemm_isa() or 'torch._int_mm'}, "
            f"MoE GEMM {ops.moe_gemm_isa() or 'per-expert oneDNN'})")
