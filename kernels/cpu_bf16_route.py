"""Which bf16 GEMM a batch of rows takes on an AMX CPU, measured on the machine at load.

On a CPU with AVX512-BF16 and no AMX, bf16 linears run the native panel GEMM for every batch
(``kernels/cpu_gemm.py``). On an AMX CPU oneDNN runs AMX tiles, many times the panel GEMM's arithmetic a cycle:
prefill wants them. A decode batch is another matter: a few rows read every weight once, the step is bound by how
fast the weights stream, and where this was measured oneDNN streams them slower than the panel GEMM (Zen 4, the
1.1B shape: 1.15-1.5x slower for 1-8 rows; no AMX CPU has been available to this project). So on an AMX CPU, with
``TANDEM_CPU_BF16_GEMM=auto``, such linears keep the panel copy beside oneDNN's when the extra copy fits in memory
(``panels_fit``), and ``calibrate_for_model`` times both products on the first layer's matrices (their sum, as a
step runs them) at ``CANDIDATE_ROWS``, from the fewest rows up, alternating. ``cpu_gemm.AMX_PANELS_MAX_ROWS`` becomes
the most rows up to which the panel GEMM won every count timed (it stops at the first count oneDNN wins), and every
layer lets go of the copy its route never reads: all the panel copies where oneDNN won from one row, oneDNN's where
the panels won every count. Once per process (a later model, a draft, is routed the same way), logged.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from kernels import cpu_gemm
from kernels.route_timing import best_of_alternating, measure_rows, native_max_rows, timings_text

logger = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 4, 8, 16, 32, 64, 128)  # one row: a lone decode
CALIBRATION_REPEATS = 3
# the panel copies are made beside oneDNN's only while they take at most this share of the memory available
MEMORY_SHARE = 0.25


def memory_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def panel_bytes(model: torch.nn.Module) -> int:
    """What the panel copies of the model's bf16 linears (and its output projection) would take."""
    weights = [m.weight for m in model.modules() if hasattr(m, "gemm") and getattr(m, "weight", None) is not None]
    if hasattr(model, "output_weight") and getattr(model, "lm_head", None) is None:
        weights.append(model.output_weight())  # tied: the output projection gets a GEMM of its own
    return sum(w.numel() * 2 for w in weights if w.dtype == torch.bfloat16)


def panels_fit(model: torch.nn.Module, available: int | None = None) -> bool:
    """Whether this model's linears may keep the panel copy beside oneDNN's: an AMX CPU (``TANDEM_CPU_BF16_GEMM=auto``)
    and the copies within ``MEMORY_SHARE`` of the memory available (the route is measured after they are made)."""
    if not cpu_gemm.bf16_panels_beside_onednn():
        return False
    needed = panel_bytes(model)
    if needed == 0:
        return False
    available = memory_available_bytes() if available is None else available
    if available is None or needed > MEMORY_SHARE * available:
        logger.info("bf16 linears on this AMX CPU: oneDNN for every batch (a panel copy for decode batches would take "
                    "%.2f GiB of %s available)", needed / 2**30,
                    "unknown" if available is None else f"{available / 2**30:.1f} GiB")
        return False
    return True


def calibration_gemms(model: torch.nn.Module) -> list:
    """The ``CpuLinear``s of the model's first layer that hold both copies, one per distinct shape."""
    gemms, shapes = [], set()
    for module in model.modules():
        gemm = getattr(module, "gemm", None)
        if not isinstance(gemm, cpu_gemm.CpuLinear) or gemm.panels is None or gemm.packed is None:
            continue
        shape = (gemm.panels.in_features, gemm.out_features)
        if shape in shapes:
            break  # the next layer begins: the same shapes again
        shapes.add(shape)
        gemms.append(gemm)
    return gemms


def time_products(gemms: list, rows: int, repeats: int = CALIBRATION_REPEATS) -> tuple[float, float]:
    """Best seconds of the panel GEMM and of oneDNN over all ``gemms`` for ``rows`` rows, alternating."""
    generator = torch.Generator().manual_seed(rows)
    inputs = [torch.randn(rows, g.panels.in_features, generator=generator).to(torch.bfloat16) for g in gemms]

    def panels() -> None:
        for g, x in zip(gemms, inputs):
            g.panel_product(x)

    def onednn() -> None:
        for g, x in zip(gemms, inputs):
            g.onednn_product(x)
    return best_of_alternating(panels, onednn, repeats)


def measure(gemms: list, rows=CANDIDATE_ROWS) -> list[tuple[int, float, float]]:
    """(rows, panels s, oneDNN s) from the fewest rows up, stopping after the first count oneDNN wins."""
    return measure_rows(lambda num_rows: time_products(gemms, num_rows), rows)


_calibrated = False


def calibrate_for_model(model: torch.nn.Module,
                        measure_timings: Callable[[list], list] | None = None) -> None:
    """A model whose linears hold both copies (an AMX CPU's): measure once per process (``measure_timings``,
    default ``measure``), set ``cpu_gemm.AMX_PANELS_MAX_ROWS``, and let every layer go of the copy it never reads."""
    global _calibrated
    gemms = calibration_gemms(model)
    if not gemms:
        return
    if not _calibrated:
        _calibrated = True
        started = time.perf_counter()
        try:
            timings = (measure_timings or measure)(gemms)
        except Exception:  # noqa: BLE001 - a measurement must not stop the model from loading: oneDNN, as before
            logger.exception("bf16 linears on this AMX CPU: measuring the panel GEMM failed; oneDNN for every batch")
            cpu_gemm.set_amx_panels_max_rows(0, "measurement failed")
        else:
            cpu_gemm.set_amx_panels_max_rows(native_max_rows(timings))
            logger.info("bf16 linears on this AMX CPU: %s (measured in %.2f s on the first layer's %d matrices, %d "
                        "threads; rows: panels / oneDNN ms %s)", cpu_gemm.describe_bf16_route(),
                        time.perf_counter() - started, len(gemms), torch.get_num_threads(), timings_text(timings))
    holders = {id(g): g for m in model.modules() for g in (getattr(m, "gemm", None), getattr(m, "logits_gemm", None))
               if isinstance(g, cpu_gemm.CpuLinear)}
    released = sum(g.release_unread_copy() for g in holders.values())
    if released:
        logger.info("bf16 linears: let go of %.2f GiB of weight copies no batch reads", released / 2**30)
