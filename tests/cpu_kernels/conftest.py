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
