"""The native CPU kernels (``kernels/native``) against their torch references, on every instruction set
this CPU runs. CI builds the module (setup.py, with the C compiler the machine has); where it is not
built these tests are skipped, and ``test_native_fallback.py`` checks the torch path instead."""

from __future__ import annotations

import os

import pytest

from kernels import cpu_native

NATIVE_OFF = os.environ.get("TANDEM_NATIVE_KERNELS", "1").lower() in ("0", "false", "off", "no")


@pytest.fixture(params=cpu_native.ops.supported_isas() if cpu_native.ops is not None else ["none"])
def isa(request):
    """Each instruction set this CPU runs (AVX-512, AVX2, 16-byte vectors, scalar), restored afterwards."""
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built (or TANDEM_NATIVE_KERNELS=0)")
    before = cpu_native.ops.isa()
    cpu_native.ops.set_isa(request.param)
    yield request.param
    cpu_native.ops.set_isa(before)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def panels(monkeypatch):
    """bf16 linears on the native panel GEMM (``TANDEM_CPU_BF16_GEMM=panels``), with its portable body where this CPU
    has no AVX512-BF16, and the one-call decoder stack on (its default)."""
    from kernels import cpu_decoder_stack, cpu_gemm

    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    before = cpu_native.ops.moe_gemm_isa()
    if before is None:
        cpu_native.ops.set_moe_gemm_isa("portable")
    monkeypatch.setenv(cpu_gemm.BF16_GEMM_ENV, "panels")
    monkeypatch.delenv(cpu_decoder_stack.SWITCH_ENV, raising=False)
    yield
    cpu_native.ops.set_moe_gemm_isa(before)


GEMM_BODIES = cpu_native.ops.supported_int8_gemm_isas() if cpu_native.ops is not None else []


def chosen_gemm(name: str | None):
    """The int8 GEMM body ``name`` (None: none, as without VNNI) for a fixture's duration."""
    before = cpu_native.ops.int8_gemm_isa()
    cpu_native.ops.set_int8_gemm_isa(name)
    yield name
    cpu_native.ops.set_int8_gemm_isa(before)


@pytest.fixture(params=GEMM_BODIES)
def gemm_body(request):
    """Each int8 GEMM body this CPU runs (the portable one on every CPU)."""
    yield from chosen_gemm(request.param)
