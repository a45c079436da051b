"""The native module is built where a C compiler is (CI's machine has one): without it every CPU kernel
silently falls back to the torch references, which would hide a broken build."""

from __future__ import annotations

import shutil

import pytest
import torch

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
    # and its twin with attention in bf16 pairs, the avx512_bf16 logic, likewise
    assert "vec512_bf16" in cpu_native.ops.supported_isas()
    assert cpu_native.ops.isa() != "vec512_bf16"


@pytest.mark.skipif(NATIVE_OFF, reason="TANDEM_NATIVE_KERNELS=0 turns the native kernels off")
def test_a_cpu_with_avx512_bf16_runs_attention_in_bf16_pairs():
    """The body chosen at import follows the CPU's flags: AVX512-BF16 (Zen 4 and 5, Cooper Lake, Sapphire Rapids
    on) runs attention's bf16 products in vdpbf16ps, other AVX-512 CPUs the widening body."""
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    flags = cpu_native.cpu_flags()
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        pytest.skip("this CPU has no AVX-512")
    expected = "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    assert cpu_native.ops.isa() == expected
    assert (expected == "avx512_bf16") == ("avx512_bf16" in cpu_native.ops.supported_isas())


def test_auto_on_cpu_is_the_cpu_set_with_every_kernel():
    kernels = load_kernels("auto", "cpu")
    assert kernels.name.startswith("cpu")
    assert cpu_native.describe() in kernels.name
    if cpu_native.ops is not None:
        assert describe_prompt_route() in kernels.name  # an AMX CPU's int8 route follows it


def test_the_name_says_what_a_model_of_each_dtype_runs():
    """A float16 model (the native kernels and packed GEMMs take fp32 and bf16) and DeepSeek's latent attention run
    torch's references: the start-up line must not call them native."""
    half = load_kernels("cpu", "cpu", torch.float16).name
    assert half.startswith("cpu: torch reference (float16: the native kernels and packed GEMMs take float32 and "
                           "bfloat16; --dtype bfloat16 runs them)") and "native (" not in half
    assert "prompt attention" not in half
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    bf16 = load_kernels("cpu", "cpu", torch.bfloat16).name
    assert bf16 == load_kernels("cpu", "cpu").name and bf16.startswith(f"cpu: {cpu_native.describe()}")
    latent = load_kernels("cpu", "cpu", torch.bfloat16, latent_attention=True).name
    assert "latent attention native" in latent and "prompt attention" not in latent


def test_a_switch_value_neither_on_nor_off_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_native, "_switch", "maybe")
    monkeypatch.setenv(cpu_native.SWITCH_ENV, "maybe")
    with pytest.raises(ValueError, match="TANDEM_NATIVE_KERNELS='maybe': use 1 .* or 0"):
        load_kernels("cpu", "cpu")
    for value in ("1", "on", "0", "off"):
        monkeypatch.setattr(cpu_native, "_switch", value)
        load_kernels("cpu", "cpu")


def test_unknown_isa_is_refused():
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    with pytest.raises(ValueError, match="unknown instruction set"):
        cpu_native.ops.set_isa("avx9000")
