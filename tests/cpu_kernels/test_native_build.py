"""The native module is built where a C compiler is (CI's machine has one): without it every CPU kernel
silently falls back to the torch references, which would hide a broken build."""

from __future__ import annotations

import shutil

import pytest

from kernels import cpu_native, load_kernels
from kernels.cpu_paged_attention import describe_prompt_route
from tests.cpu_kernels.conftest import NATIVE_OFF


@pytest.mark.skipif(NATIVE_OFF, reason="TANDEM_NATIVE_KERNELS=0 turns the native kernels off")
def test_native_module_is_built_where_a_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch references are the CPU path")
    assert cpu_native.ops is not None, "kernels._cpu_ops is not built (pip install -e . with a C compiler)"
    assert cpu_native.ops.isa() in cpu_native.ops.supported_isas()
    assert "scalar" in cpu_native.ops.supported_isas()
    # the portable 16-lane body runs the avx512 logic in every machine's tests, never in serving
    assert "vec512" in cpu_native.ops.supported_isas()
    assert cpu_native.ops.isa() != "vec512"


def test_auto_on_cpu_is_the_cpu_set_with_every_kernel():
    kernels = load_kernels("auto", "cpu")
    assert kernels.name.startswith("cpu")
    assert cpu_native.describe() in kernels.name
    assert kernels.name.endswith(describe_prompt_route())


def test_unknown_isa_is_refused():
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    with pytest.raises(ValueError, match="unknown instruction set"):
        cpu_native.ops.set_isa("avx9000")
