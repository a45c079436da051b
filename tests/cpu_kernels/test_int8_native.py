"""The native W8A8 int8 pieces (``kernels/cpu_int8.py``) against quantization/int8.py's torch code, bit for bit:
the quantize pass on every vector instruction set this CPU runs, the int8 GEMM on every body (AVX-512 VNNI where
the CPU has it, the portable one everywhere) against ``torch._int_mm``, and ``Int8Linear`` / the int8 experts
through each path (packed GEMM, ``torch._int_mm`` between the native passes, torch alone)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8, cpu_native, load_kernels
from pipeline.quantization.int8 import Int8Linear, int8_product, quantize_per_row, quantize_with_scale
from pipeline.quantization.int8_experts import Int8StackedExperts
from tests.cpu_kernels.conftest import GEMM_BODIES, chosen_gemm

pytestmark = pytest.mark.skipif(cpu_native.ops is None, reason="kernels._cpu_ops is not built")

# rows 1..17 (decode batches and a tile tail), K and N off the kernels' multiples of 4 / 16 / 64, and the
# TinyLlama-1.1B shapes' K
ODD_SHAPES = [(1, 1, 1), (2, 3, 15), (5, 33, 17), (6, 64, 64), (7, 130, 100), (12, 2048, 80), (13, 5632, 65),
              (17, 67, 129)]


@pytest.fixture(params=GEMM_BODIES + [None], ids=lambda name: name or "int_mm")
def int8_gemm_isa(request):
    """Each int8 GEMM body, and None: torch._int_mm between the native passes (what a CPU without VNNI runs)."""
    yield from chosen_gemm(request.param)


def activations(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows, with the cases that decide a rounding: an all-zero row, and a row whose scale is exactly 1
    (absmax 127) holding ties (2.5, -0.5, 126.5) that round half to even."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    if rows >= 3 and cols >= 4:
        x[1] = 0
        x[2, :4] = torch.tensor([127.0, 2.5, -0.5, 126.5])
        x[2, 4:] = x[2, 4:].clamp(-100, 100)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 33, 64, 130, 2048, 5632])
def test_quantize_is_quantize_per_row(isa, threads, dtype, cols):
    """Same int8 values and scales as the torch passes: absmax, fp32 division (not a reciprocal multiply),
    round half to even, clamp; the offset-128 codes are the same values + 128, padding the code of zero."""
    x = activations(17, cols, dtype)
    want_q, want_scale = quantize_per_row(x)
    got_q, got_scale = cpu_int8.quantize(x)
    assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)
    codes, scale = cpu_int8.quantize(x, None, 128, cols + 5)
    assert torch.equal(codes[:, :cols].to(torch.int16) - 128, want_q.to(torch.int16)) and torch.equal(scale, want_scale)
    assert bool((codes[:, cols:] == 128).all())
    if cols >= 4:
        assert got_q[2, :4].tolist() == [127, 2, 0, 126]  # ties to even, as torch.round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_scale_quantize(isa, dtype):
    """A static scale: q = round(x / s) clamped (the clamp matters: x of std 3 against s = 0.02), bf16 rows
    divided in fp32 as the torch code divides them."""
    x = activations(9, 130, dtype)
    scale = torch.tensor(0.02)
    got, got_scale = cpu_int8.quantize(x, scale)
    assert torch.equal(got, quantize_with_scale(x, scale)) and got_scale is scale


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 17, 64, 2560])
def test_rescale_is_the_torch_rescale(isa, threads, out_dtype, cols):
    generator = torch.Generator().manual_seed(1)
    acc = torch.randint(-2**31, 2**31 - 1, (13, cols), dtype=torch.int32, generator=generator)
    acc[0] = torch.randint(-2**20, 2**20, (cols,), dtype=torch.int32, generator=generator)
    x_scale, scale_row = torch.rand(13, 1, generator=generator) / 100, torch.rand(1, cols, generator=generator) / 100
    bias = torch.randn(cols, generator=generator).to(out_dtype)
    want = acc.float().mul_(x_scale).mul_(scale_row).add_(bias).to(out_dtype)
    assert torch.equal(cpu_int8.rescale(acc, x_scale, scale_row, bias.float(), out_dtype), want)
    assert torch.equal(cpu_int8.rescale(acc, x_scale, scale_row, None, out_dtype),
                       acc.float().mul_(x_scale).mul_(scale_row).to(out_dtype))


def packed_case(rows: int, k: int, n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight_q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)  # [out, in]
    x_q = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=generator)
    return weight_q, x_q


@pytest.mark.parametrize("rows,k,n", ODD_SHAPES)
def test_gemm_is_int_mm_bit_for_bit(gemm_body, threads, rows, k, n):
    weight_q, x_q = packed_case(rows, k, n)
    weight = cpu_int8.pack(weight_q, torch.ones(n), None)
    codes = torch.nn.functional.pad((x_q.to(torch.int16) + 128).to(torch.uint8), (0, 4 * weight.packed.shape[1] - k),
                                    value=128)
    got = cpu_int8.gemm(codes, weight, None, torch.int32)
    assert torch.equal(got, torch._int_mm(x_q, weight_q.t().contiguous()))


def test_gemm_extremes_are_exact(gemm_body):
    """Every product at its extreme (-128 x -128, 127 x -128), K = 5632: sums far past int16, exact in int32."""
    k, n = 5632, 80
    weight_q = torch.full((n, k), -128, dtype=torch.int8)
    weight_q[1::2] = 127
    x_q = torch.tensor([[-128] * k, [127] * k, [-128, 127] * (k // 2)], dtype=torch.int8)
    weight = cpu_int8.pack(weight_q, torch.ones(n), None)
    codes = (x_q.to(torch.int16) + 128).to(torch.uint8)
    want = x_q.long() @ weight_q.long().t()
    assert torch.equal(cpu_int8.gemm(codes, weight, None, torch.int32).long(), want)
    assert torch.equal(torch._int_mm(x_q, weight_q.t().contiguous()).long(), want)


def int8_linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool, static_input: bool,
                seed: int = 0) -> Int8Linear:
    """A W8A8 layer, loaded as from a checkpoint; ``reference_weight_t`` keeps its int8 ``[in, out]`` weight for
    ``torch_path`` (the layer itself may keep only its packed copy)."""
    generator = torch.Generator().manual_seed(seed)
    weight_q, weight_scale = quantize_per_row(torch.randn(out_features, in_features, generator=generator))
    layer = Int8Linear(in_features, [out_features], bias, dtype, "cpu", is_prequantized=True, static_input=static_input)
    layer.weight.data.copy_(weight_q)
    layer.weight_scale.data.copy_(weight_scale)
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=generator))
    if static_input:
        layer.input_scale.data.fill_(0.02)
    layer.finish_loading()
    layer.reference_weight_t = weight_q.t().contiguous()
    return layer


def torch_path(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The torch code's result: ``int8_product`` + bias, to the layer's dtype."""
    out = int8_product(x, layer.reference_weight_t, layer.scale_row, layer.act_scale)
    if layer.bias is not None:
        out = out.add_(layer.bias)
    return out.to(layer.dtype)


@pytest.mark.parametrize("static_input", [False, True], ids=["per_token", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,n", [(1, 2048, 2560), (12, 2048, 100), (17, 130, 65), (40, 64, 96)])
def test_int8_linear_equals_the_torch_path(int8_gemm_isa, threads, static_input, dtype, rows, k, n):
    layer = int8_linear(k, n, dtype, bias=True, static_input=static_input)
    assert (layer.matrix.packed is not None) == (int8_gemm_isa is not None)
    x = activations(rows, k, dtype, seed=5)
    assert torch.equal(layer(x), torch_path(layer, x))


def test_amx_sends_batches_to_int_mm(monkeypatch):
    """On an AMX CPU, more rows than a decode's go to torch._int_mm (oneDNN's AMX kernels), with the same result."""
    if not cpu_int8.native_gemm_available():
        pytest.skip("no native GEMM body on this CPU")
    monkeypatch.setattr(cpu_int8, "_IS_AMX", True)
    layer = int8_linear(64, 96, torch.bfloat16, bias=True, static_input=False)
    assert layer.weight_t is not None and layer.weight.untyped_storage().data_ptr() == \
        layer.weight_t.untyped_storage().data_ptr()  # torch._int_mm's layout kept, and held once
    x = activations(cpu_int8.AMX_PACKED_MAX_ROWS + 1, 64, torch.bfloat16)
    want, calls = torch_path(layer, x), []
    monkeypatch.setattr(torch, "_int_mm", lambda *args, real=torch._int_mm: calls.append(1) or real(*args))
    assert torch.equal(layer(x), want) and len(calls) == 1
    layer(x[:cpu_int8.AMX_PACKED_MAX_ROWS])
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_packed_gemm_takes_every_call_the_int8_weight_is_held_once(monkeypatch, gemm_body, dtype):
    """No AMX: every batch takes the packed GEMM, so torch._int_mm's ``[in, out]`` copy is not kept (the parameter
    keeps its shape on the meta device); any input shape still gets the torch path's result."""
    monkeypatch.setattr(cpu_int8, "_IS_AMX", False)
    layer = int8_linear(64, 96, dtype, bias=True, static_input=False)
    assert layer.weight_t is None and layer.matrix.weight_t is None
    assert layer.weight.is_meta and layer.weight.shape == (96, 64) and layer.weight.dtype == torch.int8
    for x in (activations(0, 64, dtype), activations(1, 64, dtype), activations(300, 64, dtype)):
        assert torch.equal(layer(x), torch_path(layer, x))
    batch = activations(6, 64, dtype).view(2, 3, 64)
    assert torch.equal(layer(batch), torch_path(layer, batch.reshape(6, 64)).view(2, 3, 96))
    wide = activations(5, 128, dtype)[:, ::2]  # every other column: a stride the native passes do not take
    assert torch.equal(layer(wide), torch_path(layer, wide.contiguous()))


def test_without_the_module_int8_runs_the_torch_code(monkeypatch):
    monkeypatch.setattr(cpu_native, "ops", None)
    layer = int8_linear(64, 96, torch.float32, bias=True, static_input=False)
    assert not layer.matrix.is_native and layer.matrix.packed is None
    x = activations(5, 64, torch.float32)
    assert torch.equal(layer(x), torch_path(layer, x))


def test_int8_experts_equal_the_torch_path(int8_gemm_isa):
    generator = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, top_k, tokens = 4, 64, 40, 2, 11
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.1
    down = torch.randn(num_experts, hidden, inter, generator=generator) * 0.1
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=generator)
    kernels = load_kernels("cpu")
    native = Int8StackedExperts(gate_up.to(torch.bfloat16), down.to(torch.bfloat16))
    assert all(matrix.packed is not None for pair in native.matrices for matrix in pair) == (int8_gemm_isa is not None)
    got = native(x, topk_weights, topk_ids, kernels)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_native, "ops", None)
        reference = Int8StackedExperts(gate_up.to(torch.bfloat16), down.to(torch.bfloat16))
        assert not reference.matrices[0][0].is_native
    # the torch experts with the same kernels (the SiLU between the GEMMs is the CPU set's in both)
    want = reference(x, topk_weights, topk_ids, kernels)
    assert torch.equal(got, want)
