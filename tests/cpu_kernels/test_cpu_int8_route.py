"""``kernels/cpu_int8_route.py``: on an AMX CPU, preparing a model with int8 layers measures the packed GEMM against
torch._int_mm on its first layer and sets the row count between them; nowhere else is anything measured. Timings
are injected where a decision is asserted; the real measurement runs once, its decision unasserted."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import cpu_int8, cpu_int8_route
from kernels.cpu_int8_route import calibration_matrices
from tests.cpu_kernels.test_int8_native import activations, int8_linear, torch_path


class TinyInt8Model(torch.nn.Module):
    """Two layers of a Llama's int8 linears (q/k/v, o, gate/up, down shapes), bf16 activations."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([
            torch.nn.ModuleDict({"qkv": int8_linear(64, 128, torch.bfloat16, bias=False, static_input=False),
                                 "o": int8_linear(64, 64, torch.bfloat16, bias=False, static_input=False),
                                 "gate_up": int8_linear(64, 256, torch.bfloat16, bias=True, static_input=False),
                                 "down": int8_linear(128, 64, torch.bfloat16, bias=False, static_input=False)})
            for _ in range(2)])


@pytest.fixture
def amx(monkeypatch):
    """An AMX CPU as the int8 code sees it (layers built now keep torch._int_mm's layout beside the packed one)."""
    if not cpu_int8.native_gemm_available():
        pytest.skip("no native int8 GEMM body on this CPU")
    monkeypatch.setattr(cpu_int8, "_IS_AMX", True)
    monkeypatch.setattr(cpu_int8, "AMX_PACKED_MAX_ROWS", 16)
    monkeypatch.setattr(cpu_int8, "AMX_ROUTE_SOURCE", "default")
    monkeypatch.setattr(cpu_int8_route, "_calibrated", False)
    return cpu_int8


def test_the_first_layers_matrices_are_timed_one_per_shape(amx):
    shapes = [tuple(m.weight_t.shape) for m in calibration_matrices(TinyInt8Model())]
    assert shapes == [(64, 128), (64, 64), (64, 256), (128, 64)]


@pytest.mark.parametrize("timings, expected", [([(16, 1.0, 2.0), (32, 1.0, 2.0), (64, 3.0, 2.0)], 32),
                                               ([(16, 1.0, 2.0), (256, 1.0, 2.0)], None)])
def test_an_amx_cpu_sets_the_route_from_the_measurement(amx, caplog, timings, expected):
    model, asked = TinyInt8Model(), []

    def fake_measure(matrices, dtype):
        asked.append((len(matrices), dtype))
        return timings
    with caplog.at_level(logging.INFO, logger="kernels.cpu_int8_route"):
        cpu_int8_route.calibrate_for_model(model, fake_measure)
    assert asked == [(4, torch.bfloat16)]
    assert amx.AMX_PACKED_MAX_ROWS == expected and amx.describe_amx_route().endswith("(calibrated)")
    assert amx.describe_amx_route() in caplog.text
    cpu_int8_route.calibrate_for_model(model, fake_measure)  # once per process
    assert len(asked) == 1
    # the same values whichever product a batch takes
    layer = model.layers[0]["gate_up"]
    for rows in (3, 17, 40, 300):
        x = activations(rows, 64, torch.bfloat16, seed=rows)
        assert torch.equal(layer(x), torch_path(layer, x))


def test_nothing_is_measured_without_amx(monkeypatch):
    monkeypatch.setattr(cpu_int8, "_IS_AMX", False)
    monkeypatch.setattr(cpu_int8_route, "_calibrated", False)
    asked = []
    cpu_int8_route.calibrate_for_model(TinyInt8Model(), lambda matrices, dtype: asked.append(1) or [])
    assert asked == [] and cpu_int8.describe_amx_route() is None
    assert all(cpu_int8.packed_gemm_preferred(rows) for rows in (1, 16, 17, 4096))


def test_the_real_measurement_stops_at_the_first_count_the_amx_path_wins(amx):
    matrices = calibration_matrices(TinyInt8Model())
    timings = cpu_int8_route.measure(matrices, torch.bfloat16, rows=(2, 8))
    assert [rows for rows, _, _ in timings] in ([2], [2, 8])
    assert all(p > 0 and a > 0 for _, p, a in timings)
    assert len(timings) == 2 or timings[0][1] > timings[0][2]


def test_preparing_a_model_for_the_cpu_calibrates_its_int8_layers(amx, monkeypatch):
    from kernels.cpu_backend import prepare_model_cpu

    monkeypatch.setattr(cpu_int8_route, "measure", lambda matrices, dtype: [(16, 1.0, 2.0), (32, 3.0, 2.0)])
    prepare_model_cpu(TinyInt8Model())
    assert amx.AMX_PACKED_MAX_ROWS == 16 and amx.AMX_ROUTE_SOURCE == "calibrated"
