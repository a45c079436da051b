"""make gpu-check's dry run on the CPU: every stage recorded in one JSON of the GPU run's shape, what needs
CUDA skipped with the reason, the rest run in their reduced form (the P/D cluster stage, which starts a
cluster, is left to the full dry run: docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import gpu_check

REPO_ROOT = Path(__file__).resolve().parents[2]
FAST_STAGES = ["wheels", "environment", "pytest_gpu", "pytest_kernels", "kernel_numbers", "kv_transfer",
               "offline_throughput"]


def test_dry_run_writes_one_report_with_every_stage(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out),
                           "--only", ",".join(FAST_STAGES)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert (out / "gpu-check.log").stat().st_size > 0
    assert report["mode"] == "dry-run" and report["summary"]["ok"]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(gpu_check.STAGE_NAMES)
    for stage in stages.values():
        assert {"name", "status", "seconds", "timeout_s", "reason"} <= set(stage)
    assert stages["pytest_kernels"]["reason"] == "skipped: no CUDA (dry run)"
    assert stages["pd_cluster"]["status"] == "skipped"
    assert report["environment"]["import_failures"] == {} and report["environment"]["cuda_available"] is False
    # the gpu tests are collected and skip cleanly without CUDA
    gpu_tests = stages["pytest_gpu"]
    assert gpu_tests["status"] == "passed" and gpu_tests["skipped"] == len(gpu_tests["tests"]) > 0
    assert any("test_cuda_engine" in t["test"] for t in gpu_tests["tests"])
    for name in ("kernel_numbers", "kv_transfer", "offline_throughput"):
        assert stages[name]["status"] == "passed", stages[name]
        assert stages[name]["result"]["device"] == "cpu"
    by_transport = stages["kv_transfer"]["result"]["by_transport"]
    assert list(by_transport) == ["zmq"] and by_transport["zmq"]["transports_seen"] == ["zmq"]  # no cuda_ipc on CPU
    assert stages["offline_throughput"]["result"]["tandem"]["output_tok_per_s"] > 0


def test_wheel_list_names_what_the_device_image_lacks():
    names = {name for name, _ in gpu_check.wheel_requirements()}
    assert {"pyzmq", "msgspec", "pydantic", "pydantic-core", "fastapi", "uvicorn", "llguidance",
            "setproctitle"} <= names
    assert not names & {"torch", "triton", "transformers", "numpy"}  # the image's own are never replaced


def test_carried_wheels_are_checked_against_the_list(tmp_path):
    (tmp_path / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    (tmp_path / "msgspec-0.22.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"x")
    checked = gpu_check.check_wheel_dir(tmp_path)
    assert checked["num_wheels"] == 2
    problems = "\n".join(checked["problems"])
    assert "msgspec-0.22.0-cp311" in problems and "not for CPython 3.12" in problems
    assert "pydantic==2.14.4: 0 wheels" in problems and "pyzmq==" not in problems


def test_gpu_marked_files_outside_the_kernel_tests_are_found():
    files = gpu_check.marked_test_files()
    assert "tests/gpu/test_cuda_engine.py" in files
    assert not any(f.startswith("tests/kernels/") for f in files)
