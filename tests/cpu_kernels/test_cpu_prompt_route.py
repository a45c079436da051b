"""``kernels/cpu_prompt_route.py``: on an AMX CPU a bf16 model's prepare measures both prompt-attention paths and
routes from the crossover; nowhere else is anything measured or changed. Timings are injected where a decision is
asserted (nothing here depends on this machine's speed); the real measurement runs once, its decision unasserted."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import cpu_native, cpu_paged_attention, cpu_prompt_route
from kernels.cpu_prompt_route import attention_geometry, calibrate_for_model, crossover
from tests.paged_batches import make_batch


def case(rows, native, torch_, prefix=0):
    return {"rows": rows, "prefix": prefix, "native_ns_per_pair": native, "torch_ns_per_pair": torch_}


def test_the_crossover_is_where_torch_wins_from_then_on():
    assert crossover([case(16, 1.0, 2.0), case(64, 1.0, 0.5), case(256, 1.0, 0.4)]) == 64
    # one chunk shape past it where native wins moves it up
    assert crossover([case(64, 1.0, 0.5), case(64, 1.0, 1.5, prefix=1024), case(256, 1.0, 0.4)]) == 256
    assert crossover([case(16, 1.0, 2.0), case(64, 1.0, 1.5)]) is None


class TinyAttention(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.num_q_heads, self.num_kv_heads, self.head_dim = 4, 2, 32
        self.qkv_proj = torch.nn.Linear(128, 256, bias=False, dtype=dtype)


class TinyModel(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.layers = torch.nn.ModuleList([TinyAttention(dtype)])


@pytest.fixture
def route(monkeypatch):
    """The route as this process has it, restored after the test; an AMX CPU's flags, the native kernels built."""
    monkeypatch.setattr(cpu_paged_attention, "FLASH_MIN_QUERY_ROWS", 64)
    monkeypatch.setattr(cpu_paged_attention, "FLASH_ROUTE_SOURCE", "default")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16", "amx_tile"}))
    monkeypatch.setattr(cpu_native, "ops", cpu_native.ops or object())
    monkeypatch.delenv("TANDEM_CPU_FLASH_MIN_QUERY_ROWS", raising=False)
    return cpu_paged_attention


def measured(crossing_rows):
    """A stand-in for ``measure``: torch's path faster from ``crossing_rows`` (None: never), and the heads it got."""
    asked = []

    def measure_cases(num_q_heads, num_kv_heads, head_dim):
        asked.append((num_q_heads, num_kv_heads, head_dim))
        return [case(rows, 1.0, 0.5 if crossing_rows is not None and rows >= crossing_rows else 2.0, prefix)
                for prefix in (0, 512) for rows in cpu_prompt_route.CANDIDATE_ROWS]
    return measure_cases, asked


@pytest.mark.parametrize("crossing_rows", [64, 256, None])
def test_an_amx_cpu_routes_a_bf16_model_from_the_measured_crossover(route, crossing_rows, caplog):
    measure_cases, asked = measured(crossing_rows)
    with caplog.at_level(logging.INFO, logger="kernels.cpu_prompt_route"):
        assert calibrate_for_model(TinyModel(), measure_cases) == crossing_rows
    assert asked == [(4, 2, 32)]  # the model's own heads
    assert route.FLASH_MIN_QUERY_ROWS == crossing_rows and route.FLASH_ROUTE_SOURCE == "calibrated"
    assert route.describe_prompt_route().endswith("(calibrated)")
    assert route.describe_prompt_route() in caplog.text
    # once per process: a second model (a draft) keeps it
    again, asked_again = measured(128)
    assert calibrate_for_model(TinyModel(), again) == crossing_rows and asked_again == []


@pytest.mark.parametrize("why", ["fp32 model", "no AMX", "set by hand", "latent attention"])
def test_nothing_is_measured_or_changed_elsewhere(route, monkeypatch, why):
    model = TinyModel(torch.float32 if why == "fp32 model" else torch.bfloat16)
    if why == "no AMX":
        monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    if why == "set by hand":
        monkeypatch.setenv("TANDEM_CPU_FLASH_MIN_QUERY_ROWS", "64")
    if why == "latent attention":
        del model.layers[0].qkv_proj
    measure_cases, asked = measured(128)
    assert calibrate_for_model(model, measure_cases) == 64
    assert asked == [] and route.FLASH_ROUTE_SOURCE == "default"


def test_the_geometry_is_read_from_the_attention_layers():
    assert attention_geometry(TinyModel()) == (4, 2, 32, torch.bfloat16)
    assert attention_geometry(torch.nn.Linear(2, 2)) is None


def test_the_real_measurement_times_both_paths_and_restores_the_route():
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    before = cpu_paged_attention.FLASH_MIN_QUERY_ROWS
    cases = cpu_prompt_route.measure(2, 1, 32, rows=(64,), prefixes=(0, 16), repeats=1)
    assert cpu_paged_attention.FLASH_MIN_QUERY_ROWS == before
    assert [(c["rows"], c["prefix"]) for c in cases] == [(64, 0), (64, 16)]
    assert all(c["native_ns_per_pair"] > 0 and c["torch_ns_per_pair"] > 0 for c in cases)
    assert crossover(cases) in (64, None)


def test_a_calibrated_route_computes_the_same_attention(route):
    """Whatever the calibration picks, a batch mixing a long chunk and decodes gives the reference's attention."""
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    from kernels.paged_attention_ref import paged_attention_ref

    torch.manual_seed(3)
    query, k_cache, v_cache, cu, lens, tables = make_batch([70, 1, 1], [90, 20, 33], num_q_heads=4, num_kv_heads=2,
                                                           head_dim=32, page_size=16, dtype=torch.bfloat16)
    expected = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), cu, lens, tables, 32 ** -0.5)
    for crossing_rows in (64, None):
        route.set_flash_route(None, "default")
        calibrate_for_model(TinyModel(), measured(crossing_rows)[0])
        actual = cpu_paged_attention.paged_attention_cpu(query, k_cache, v_cache, cu, lens, tables, 32 ** -0.5)
        torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def test_preparing_a_model_for_the_cpu_calibrates_it(route, monkeypatch):
    from kernels.cpu_backend import prepare_model_cpu

    measure_cases, asked = measured(128)
    monkeypatch.setattr(cpu_prompt_route, "measure", measure_cases)
    prepare_model_cpu(TinyModel())
    assert asked == [(4, 2, 32)] and route.FLASH_MIN_QUERY_ROWS == 128


def test_the_measurement_stops_below_the_first_row_count_native_wins(monkeypatch):
    """From the most rows down: once the native kernel wins a chunk, fewer rows are not timed."""
    timed = []

    def fake_time_both(inputs, repeats):
        rows = inputs[0].shape[0]
        timed.append(rows)
        return [1.0], [0.5 if rows >= 256 else 2.0], 0.0
    monkeypatch.setattr(cpu_prompt_route, "time_both", fake_time_both)
    cases = cpu_prompt_route.measure(2, 1, 32, rows=(64, 128, 256), prefixes=(0, 16))
    assert timed == [256, 256, 128, 128]
    assert crossover(cases) == 256


def test_a_quantized_projection_reports_its_activations_dtype():
    """An int8 W8A8 model's attention: its weights are int8, its activations (what attention sees) bf16."""
    from tests.cpu_kernels.test_int8_native import int8_linear

    model = TinyModel()
    model.layers[0].qkv_proj = int8_linear(128, 256, torch.bfloat16, bias=False, static_input=False)
    assert attention_geometry(model) == (4, 2, 32, torch.bfloat16)
