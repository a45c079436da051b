"""The kernels compile for an NVIDIA GPU (sm_90) even on a CPU-only machine: catches what the
interpreter lets through. Marked slow (about a minute with a cold triton cache): ``pytest -m slow
tests/kernels``. Skipped where triton's NVIDIA backend or its bundled ptxas is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend_missing() -> str | None:
    try:
        import triton.backends.nvidia as nvidia
    except Exception as exc:  # a wheel built without the NVIDIA backend
        return f"triton has no NVIDIA backend ({exc})"
    if not (Path(nvidia.__file__).parent / "bin" / "ptxas").exists() and not os.environ.get("TRITON_PTXAS_PATH"):
        return "triton's bundled ptxas is missing"
    return None


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    reason = _nvidia_backend_missing()
    if reason:
        pytest.skip(reason)
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": python_path}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.compile_for_gpu", "90"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("compiled ") == 16
