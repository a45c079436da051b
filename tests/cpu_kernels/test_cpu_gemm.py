"""``CpuLinear``: oneDNN with packed weights (every row count on AVX-512, 2-256 rows elsewhere), F.linear otherwise,
the same products; bf16 layers on CPUs without bf16 GEMMs computed in fp32 and rounded, as a bf16 GEMM with fp32
accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_gemm import CpuLinear, onednn_available


@pytest.mark.parametrize("rows", [1, 2, 17, 256, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_same_product_at_every_batch_size(threads, rows, bias):
    torch.manual_seed(0)
    weight, b = torch.randn(96, 64), torch.randn(96) if bias else None
    x = torch.randn(rows, 64)
    layer = CpuLinear(weight, b)
    assert (layer.packed is not None) == onednn_available()
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_without_prepacking_it_is_f_linear():
    torch.manual_seed(1)
    weight, x = torch.randn(32, 16), torch.randn(8, 16)
    layer = CpuLinear(weight, None, prepack=False)
    assert layer.packed is None
    assert torch.equal(layer(x), F.linear(x, weight))


def test_bf16_widened_to_fp32_is_a_bf16_gemm_with_fp32_accumulation():
    torch.manual_seed(2)
    weight, x = torch.randn(48, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    layer = CpuLinear(weight, None, widen_bf16=True)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and layer.compute_dtype == torch.float32
    assert layer.weight is None or layer.weight.dtype == torch.float32  # widened, or let go once packed
    expected = (x.double() @ weight.double().T).to(torch.bfloat16)  # exact products, one rounding
    torch.testing.assert_close(out, expected, atol=0, rtol=1e-2)
    assert (out != expected).float().mean() < 0.05  # fp32 accumulation: almost always the same rounding


@pytest.mark.parametrize("rows", [1, 3])
def test_native_bf16_row_is_a_bf16_gemm_with_fp32_accumulation(threads, rows):
    # one bf16 row takes the packed oneDNN weight on any thread count where oneDNN has bf16 GEMMs
    torch.manual_seed(3)
    weight, x = torch.randn(96, 256).bfloat16(), torch.randn(rows, 256).bfloat16()
    layer = CpuLinear(weight, None)
    out = layer(x)
    expected = (x.double() @ weight.double().T).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out, expected, atol=0, rtol=1e-2)
    assert (out != expected).float().mean() < 0.05


def test_which_rows_take_the_packed_weight(monkeypatch):
    """AVX-512 CPUs: every row count (MKL, F.linear's BLAS, runs its AVX2 code on a non-Intel CPU); elsewhere 2-256."""
    from kernels import cpu_gemm, cpu_native

    if not cpu_gemm.onednn_available():
        pytest.skip("no oneDNN in this torch build")
    is_avx512 = "avx512f" in cpu_native.cpu_flags()
    assert (cpu_gemm.PACKED_MIN_ROWS, cpu_gemm.PACKED_MAX_ROWS) == ((1, None) if is_avx512 else (2, 256))
    linear = CpuLinear(torch.randn(32, 64), None)
    calls = []
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *args: calls.append(args[0].shape[0]) or torch.zeros(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS", 1)
    monkeypatch.setattr(cpu_gemm, "PACKED_MAX_ROWS", None)
    for rows in (1, 300, 2048):
        linear(torch.randn(rows, 64))
    assert calls == []
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS", 2)
    monkeypatch.setattr(cpu_gemm, "PACKED_MAX_ROWS", 256)
    for rows in (1, 2, 256, 257):
        linear(torch.randn(rows, 64))
    assert calls == [1, 257]


@pytest.mark.parametrize("rule", [(1, None), (2, 256)], ids=["avx512-rule", "avx2-rule"])
def test_the_checkpoint_layout_is_kept_only_where_a_call_reads_it(monkeypatch, rule):
    """Where the packed weight serves every row count the plain one is let go (the weights held once); where some
    calls take F.linear it stays. Either way every shape of input gets F.linear's product."""
    from kernels import cpu_gemm

    if not onednn_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS", rule[0])
    monkeypatch.setattr(cpu_gemm, "PACKED_MAX_ROWS", rule[1])
    torch.manual_seed(4)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    layer = CpuLinear(weight, bias)
    assert layer.needs_plain_weight == (rule != (1, None))
    assert (layer.weight is None) == (rule == (1, None)) and layer.holds(weight) == layer.needs_plain_weight
    for x in (torch.randn(0, 24), torch.randn(1, 24), torch.randn(2, 24), torch.randn(300, 24),
              torch.randn(3, 5, 24), torch.randn(4, 24)[:, :24].t().contiguous().t()):
        out = layer(x)
        assert out.shape == (*x.shape[:-1], 40)
        torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", [(1, 256), (3, 256), (17, 256), (300, 256), (2, 5, 256)])
def test_panel_route_is_a_bf16_gemm_with_fp32_accumulation(panels, threads, shape, has_bias):
    """bf16 linears on the native panel GEMM: the weight held once (no oneDNN copy, no checkpoint layout), any row
    count and leading shape, fp32 sums (plus the bias, Qwen2's q/k/v) rounded once, as oneDNN's bf16 GEMM computes
    them."""
    torch.manual_seed(4)
    weight, x = torch.randn(100, 256).bfloat16(), torch.randn(*shape).bfloat16()
    bias = torch.randn(100).bfloat16() * 4 if has_bias else None
    layer = CpuLinear(weight, bias)
    assert layer.panels is not None and layer.packed is None and layer.weight is None and not layer.holds(weight)
    out = layer(x)
    expected = (x.double() @ weight.double().T + (0 if bias is None else bias.double())).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 100)
    torch.testing.assert_close(out, expected, atol=0, rtol=1e-2)
    assert (out != expected).float().mean() < 0.05


def test_panel_route_leaves_fp32_layers_on_onednn(panels):
    torch.manual_seed(5)
    full = CpuLinear(torch.randn(32, 64), None)
    assert full.panels is None
    if onednn_available():
        assert full.packed is not None


def test_the_bf16_gemm_setting_is_checked_and_named(monkeypatch):
    from kernels import cpu_gemm, cpu_moe, cpu_native, load_kernels

    monkeypatch.setenv(cpu_gemm.BF16_GEMM_ENV, "fastest")
    with pytest.raises(ValueError, match="TANDEM_CPU_BF16_GEMM='fastest': use auto, onednn or panels"):
        load_kernels("cpu", "cpu")
    if cpu_native.ops is not None:  # an fp32 model's start checks it too (no bf16 layer would)
        with pytest.raises(ValueError, match="TANDEM_CPU_BF16_GEMM='fastest'"):
            load_kernels("cpu", "cpu", torch.float32)
    monkeypatch.setenv(cpu_gemm.BF16_GEMM_ENV, "panels")
    monkeypatch.setattr(cpu_moe, "native_available", lambda: False)
    with pytest.raises(ValueError, match="panels: this CPU has no AVX512-BF16"):
        CpuLinear(torch.randn(8, 8).bfloat16(), None)
    monkeypatch.setattr(cpu_moe, "native_available", lambda: True)
    if load_kernels("cpu", "cpu").name.startswith("cpu: native"):
        assert "bf16 linears native panels" in load_kernels("cpu", "cpu", torch.bfloat16).name
        assert "bf16 linears" not in load_kernels("cpu", "cpu", torch.float32).name
    monkeypatch.setenv(cpu_gemm.BF16_GEMM_ENV, "onednn")
    assert "bf16 linears" not in load_kernels("cpu", "cpu").name
    assert CpuLinear(torch.randn(8, 8).bfloat16(), None).panels is None
    # auto: the panels on a CPU with AVX512-BF16 and no AMX (where oneDNN's AMX tiles would win)
    monkeypatch.setenv(cpu_gemm.BF16_GEMM_ENV, "auto")
    for flags, expected in ((["avx512_bf16"], True), (["avx512_bf16", "amx_bf16"], False), (["avx2"], False)):
        monkeypatch.setattr(cpu_native, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_gemm.bf16_panels_preferred() is expected
        assert (CpuLinear(torch.randn(8, 8).bfloat16(), None).panels is not None) is expected
