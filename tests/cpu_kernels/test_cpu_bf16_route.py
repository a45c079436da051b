"""``kernels/cpu_bf16_route.py``: on an AMX CPU, bias-free bf16 linears keep the native panel copy beside oneDNN's
(memory permitting), preparing a model measures both on its first layer, decode-sized batches take the panels up to
the measured row count, and every layer lets go of the copy no batch reads. No AMX CPU is at hand: the fixture makes
this one look like one (its flags, and a panel GEMM body: the AVX512-BF16 one where the CPU has it, else the
portable one). Timings are injected where a decision is asserted; the real measurement runs once, unasserted."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import cpu_bf16_route, cpu_gemm, cpu_native
from kernels.cpu_backend import prepare_model_cpu
from kernels.cpu_bf16_route import calibration_gemms
from pipeline.models.layers import Linear

SHAPES = {"qkv": (64, [64, 32, 32]), "o": (64, [64]), "gate_up": (64, [128, 128]), "down": (128, [64])}


class TinyBf16Model(torch.nn.Module):
    """Two layers of a Llama's bias-free bf16 linears (q/k/v, o, gate/up, down shapes)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.ModuleDict({name: Linear(k, outs, False, torch.bfloat16, "cpu")
                                         for name, (k, outs) in SHAPES.items()})
            for linear in layer.values():
                linear.weight.data.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.1)
            self.layers.append(layer)
        self.reference = [[linear.weight.detach().float().clone() for linear in layer.values()]
                          for layer in self.layers]


@pytest.fixture
def amx(monkeypatch):
    """This CPU as an AMX one: ``amx_bf16`` among its flags, a panel GEMM body selected, the route not measured."""
    if not cpu_gemm.onednn_available() or not cpu_gemm.bf16_gemm_native() or cpu_native.ops is None:
        pytest.skip("oneDNN here has no bf16 GEMM (every AMX CPU's does)")
    flags = cpu_native.cpu_flags() | {"amx_bf16", "amx_tile", "avx512_bf16"}
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: flags)
    monkeypatch.delenv(cpu_gemm.BF16_GEMM_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm, "AMX_PANELS_MAX_ROWS", 0)
    monkeypatch.setattr(cpu_gemm, "AMX_PANELS_SOURCE", "default")
    monkeypatch.setattr(cpu_bf16_route, "_calibrated", False)
    before = cpu_native.ops.moe_gemm_isa()
    if before is None:
        cpu_native.ops.set_moe_gemm_isa("portable")
    yield
    cpu_native.ops.set_moe_gemm_isa(before)


def prepared(timings, seed: int = 0, asked: list | None = None, monkeypatch=None) -> TinyBf16Model:
    model = TinyBf16Model(seed)

    def fake_measure(gemms):
        if asked is not None:
            asked.append([(g.panels.in_features, g.out_features) for g in gemms])
        return timings
    monkeypatch.setattr(cpu_bf16_route, "measure", fake_measure)
    prepare_model_cpu(model)
    return model


def gemms_of(model: TinyBf16Model) -> list:
    return [linear.gemm for layer in model.layers for linear in layer.values()]


def check_products(model: TinyBf16Model, rows: int) -> None:
    """Each layer's product against the fp32 product of the same bf16 values (bf16 output: one rounding, plus the
    sum's order)."""
    generator = torch.Generator().manual_seed(rows)
    for layer, weights in zip(model.layers, model.reference):
        for linear, weight in zip(layer.values(), weights):
            x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
            expected = x.float() @ weight.T
            torch.testing.assert_close(linear(x).float(), expected, atol=0.02, rtol=0.02)


def test_an_amx_cpu_routes_decode_batches_to_the_panels_up_to_the_measured_rows(amx, monkeypatch, caplog):
    asked = []
    with caplog.at_level(logging.INFO, logger="kernels.cpu_bf16_route"):
        model = prepared([(1, 1.0, 2.0), (4, 1.0, 2.0), (8, 3.0, 2.0)], asked=asked, monkeypatch=monkeypatch)
    assert asked == [[(64, 128), (64, 64), (64, 256), (128, 64)]]  # the first layer, one matrix per shape
    assert cpu_gemm.AMX_PANELS_MAX_ROWS == 4 and cpu_gemm.AMX_PANELS_SOURCE == "calibrated"
    assert "bf16 batches up to 4 rows on native panels, the rest on oneDNN (AMX) (calibrated)" in caplog.text
    assert all(g.panels is not None and g.packed is not None for g in gemms_of(model))  # both copies read
    taken = []

    def spied(name):
        original = getattr(cpu_gemm.CpuLinear, name)
        return lambda self, flat: taken.append((name, flat.shape[0])) or original(self, flat)
    for name in ("panel_product", "onednn_product"):
        monkeypatch.setattr(cpu_gemm.CpuLinear, name, spied(name))
    for rows in (1, 4, 5, 40):
        taken.clear()
        check_products(model, rows)
        assert {name for name, _ in taken} == {"panel_product" if rows <= 4 else "onednn_product"}, rows


@pytest.mark.parametrize("timings, kept", [([(1, 3.0, 2.0)], "packed"), ([(1, 1.0, 2.0), (128, 1.0, 2.0)], "panels")])
def test_the_copy_no_batch_reads_is_let_go(amx, monkeypatch, timings, kept):
    model = prepared(timings, monkeypatch=monkeypatch)
    for gemm in gemms_of(model):
        assert (gemm.panels is not None, gemm.packed is not None) == (kept == "panels", kept == "packed")
    for rows in (1, 7, 130):
        check_products(model, rows)
    # measured once per process: a second model (a draft) is routed, and let go of its copies, the same way
    asked = []
    second = prepared([(1, 1.0, 2.0)], seed=1, asked=asked, monkeypatch=monkeypatch)
    assert asked == []
    assert all((g.panels is not None, g.packed is not None) == (kept == "panels", kept == "packed")
               for g in gemms_of(second))


def test_the_panel_copy_is_not_made_where_it_would_not_fit(amx, monkeypatch, caplog):
    model = TinyBf16Model()
    needed = cpu_bf16_route.panel_bytes(model)
    assert needed == sum(linear.weight.numel() * 2 for layer in model.layers for linear in layer.values())
    assert cpu_bf16_route.panels_fit(model, available=int(needed / cpu_bf16_route.MEMORY_SHARE) + 1)
    with caplog.at_level(logging.INFO, logger="kernels.cpu_bf16_route"):
        assert not cpu_bf16_route.panels_fit(model, available=needed)
    assert "oneDNN for every batch" in caplog.text
    monkeypatch.setattr(cpu_bf16_route, "memory_available_bytes", lambda: needed)
    asked = []
    model = prepared([(1, 1.0, 2.0)], asked=asked, monkeypatch=monkeypatch)
    assert asked == [] and all(g.panels is None and g.packed is not None for g in gemms_of(model))


@pytest.mark.parametrize("setting", ["onednn", "panels"])
def test_a_chosen_gemm_is_not_measured(amx, monkeypatch, setting):
    monkeypatch.setenv(cpu_gemm.BF16_GEMM_ENV, setting)
    asked = []
    model = prepared([(1, 1.0, 2.0)], asked=asked, monkeypatch=monkeypatch)
    assert asked == []
    assert all((g.panels is not None) == (setting == "panels") for g in gemms_of(model))


def test_nothing_is_measured_without_amx(monkeypatch):
    flags = cpu_native.cpu_flags() - {"amx_bf16", "amx_tile", "amx_int8"}  # this CPU without AMX, even on an AMX one
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_bf16_route, "_calibrated", False)
    asked = []
    model = prepared([(1, 1.0, 2.0)], asked=asked, monkeypatch=monkeypatch)
    assert asked == [] and not cpu_gemm.bf16_panels_beside_onednn()
    assert all(g.panels is None or g.packed is None for g in gemms_of(model))  # one copy each, as before


def test_the_real_measurement_stops_at_the_first_count_onednn_wins(amx, monkeypatch):
    model = TinyBf16Model()
    monkeypatch.setattr(cpu_bf16_route, "calibrate_for_model", lambda model: None)  # both copies kept, unrouted
    prepare_model_cpu(model)
    gemms = calibration_gemms(model)
    assert len(gemms) == 4
    timings = cpu_bf16_route.measure(gemms, rows=(2, 8))
    assert [rows for rows, _, _ in timings] in ([2], [2, 8])
    assert all(p > 0 and o > 0 for _, p, o in timings)
    assert len(timings) == 2 or timings[0][1] > timings[0][2]


def test_a_measurement_that_fails_leaves_every_batch_on_onednn(amx, monkeypatch, caplog):
    def failing(gemms):
        raise RuntimeError("no tiles today")
    monkeypatch.setattr(cpu_bf16_route, "measure", failing)
    model = TinyBf16Model()
    with caplog.at_level(logging.INFO, logger="kernels.cpu_bf16_route"):
        prepare_model_cpu(model)
    assert "measuring the panel GEMM failed" in caplog.text and "no tiles today" in caplog.text
    assert cpu_gemm.AMX_PANELS_MAX_ROWS == 0 and cpu_gemm.describe_bf16_route().endswith("(measurement failed)")
    assert all(g.panels is None and g.packed is not None for g in gemms_of(model))
    check_products(model, 3)
