"""Which int8 GEMM a batch of W8A8 rows takes on an AMX CPU, measured on the machine at load.

An int8 layer on a CPU with AVX-512 VNNI runs the native GEMM over its weight packed once at load
(``kernels/cpu_int8.py``): it reads the weight once per call, which is what a decode step wants. On a CPU with
AMX, oneDNN's AMX kernels behind ``torch._int_mm`` multiply many times more per cycle, so larger batches go there;
from how many rows depends on the CPU, the threads and the layer shapes, and no AMX CPU has been available to
this project to choose it. So when a model with int8 layers is prepared on an AMX CPU, ``calibrate_for_model``
times both products on its first layer's int8 matrices (their sum, as a step runs them) at ``CANDIDATE_ROWS``,
from the fewest rows up, alternating, and sets ``cpu_int8.AMX_PACKED_MAX_ROWS`` to the most rows up to which the
packed GEMM won every count timed (it stops at the first count the AMX path wins). Once per process, logged.
Both products give the same values bit for bit, so the choice never changes a token.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kernels import cpu_int8
from kernels.route_timing import best_of_alternating, measure_rows, native_max_rows, timings_text

logger = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 16, 32, 64, 128, 256)  # one row: a lone decode
CALIBRATION_REPEATS = 3


def calibration_matrices(model: torch.nn.Module) -> list:
    """The int8 matrices of the model's first layer that have both layouts (packed, and ``torch._int_mm``'s ``[in,
    out]``), one per distinct shape: q/k/v, o, gate/up and down in a Llama."""
    matrices, shapes = [], set()
    for module in model.modules():
        matrix = getattr(module, "matrix", None)
        if getattr(matrix, "packed", None) is None or getattr(matrix, "weight_t", None) is None:
            continue
        shape = tuple(matrix.weight_t.shape)
        if shape in shapes:
            break  # the next layer begins: the same shapes again
        shapes.add(shape)
        matrices.append(matrix)
    return matrices


def time_products(matrices: list, rows: int, dtype: torch.dtype, repeats: int = CALIBRATION_REPEATS
                  ) -> tuple[float, float]:
    """Best seconds of the packed GEMM and of ``torch._int_mm`` over all ``matrices`` for ``rows`` rows, alternating."""
    generator = torch.Generator().manual_seed(rows)
    inputs = [torch.randn(rows, m.weight_t.shape[0], generator=generator).to(dtype) for m in matrices]

    def packed() -> None:
        for m, x in zip(matrices, inputs):
            cpu_int8.packed_product(x, m.packed, m.act_scale, dtype)

    def unpacked() -> None:
        for m, x in zip(matrices, inputs):
            cpu_int8.unpacked_product(x, m.weight_t, m.scale_row, m.bias_fp32, m.act_scale, dtype)
    return best_of_alternating(packed, unpacked, repeats)


def measure(matrices: list, dtype: torch.dtype, rows=CANDIDATE_ROWS) -> list[tuple[int, float, float]]:
    """(rows, packed s, AMX s) from the fewest rows up, stopping after the first count the AMX path wins."""
    return measure_rows(lambda num_rows: time_products(matrices, num_rows, dtype), rows)


_calibrated = False


def calibrate_for_model(model: torch.nn.Module,
                        measure_timings: Callable[[list, torch.dtype], list] | None = None) -> None:
    """On an AMX CPU with the native GEMM, a model with int8 layers: measure (``measure_timings``, default
    ``measure``) and set ``cpu_int8.AMX_PACKED_MAX_ROWS``. Once per process."""
    global _calibrated
    if _calibrated or not cpu_int8.is_amx() or not cpu_int8.native_gemm_available():
        return
    matrices = calibration_matrices(model)
    dtype = _activation_dtype(model)
    if not matrices or dtype not in (torch.float32, torch.bfloat16):
        return
    started = time.perf_counter()
    timings = (measure_timings or measure)(matrices, dtype)
    cpu_int8.set_amx_packed_max_rows(native_max_rows(timings))
    _calibrated = True
    logger.info("int8 GEMMs on this AMX CPU: %s (measured in %.2f s on the first layer's %d matrices, %d threads; "
                "rows: packed / AMX ms %s)", cpu_int8.describe_amx_route(), time.perf_counter() - started,
                len(matrices), torch.get_num_threads(), timings_text(timings))


def _activation_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype the int8 layers take and give (the model's: an int8 layer's ``dtype``)."""
    return next((module.dtype for module in model.modules()
                 if isinstance(getattr(module, "dtype", None), torch.dtype) and getattr(module, "matrix", None)),
                None)
