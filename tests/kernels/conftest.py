"""Kernel tests: every triton kernel against its torch reference, on CPU through the triton interpreter.

``TRITON_INTERPRET`` decides, when a kernel module is imported, whether its kernels run compiled or
interpreted, so it is set here before anything imports triton. A run that exports
``TRITON_INTERPRET=0`` on a CUDA machine gets compiled kernels instead: that is how the tests marked
``gpu`` run (``TRITON_INTERPRET=0 pytest -m gpu tests/kernels``). Without an importable triton the
whole directory is reported as skipped, with the import error as the reason.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: F401,E402

    TRITON_MISSING: str | None = None
except Exception as exc:  # ImportError, or a broken install failing inside its own import
    TRITON_MISSING = f"triton is not importable ({type(exc).__name__}: {exc}); tests/kernels needs it"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

if TRITON_MISSING is not None:

    class _SkippedModule(pytest.Module):
        def collect(self):
            pytest.skip(TRITON_MISSING)

    def pytest_pycollect_makemodule(module_path, parent):
        return _SkippedModule.from_parent(parent, path=module_path)


@pytest.fixture
def device() -> str:
    """Where the kernels under test run: CPU under the interpreter, else the GPU."""
    if INTERPRETED:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    return "cuda"


@pytest.fixture
def cuda_device() -> str:
    """For ``gpu`` tests: compiled kernels on a CUDA device, else skip."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and compiled kernels (TRITON_INTERPRET=0)")
    return "cuda"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
