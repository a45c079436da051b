"""gpu-check stage ``environment``: the device (``nvidia-smi``'s name, driver, memory), torch / triton /
transformers versions, and whether every package Tandem imports loads in this Python.

Fails when a dependency does not import, or (not a dry run) when torch sees no CUDA device."""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys

from bench.gpu_check import stage_main

# Tandem's run-time imports (pyproject's dependencies by import name), the carried ones included
IMPORTS = ("torch", "triton", "transformers", "tokenizers", "safetensors", "jinja2", "zmq", "msgspec", "pydantic",
           "yaml", "tqdm", "fastapi", "starlette", "uvicorn", "httpx", "prometheus_client", "llguidance",
           "setproctitle", "numpy", "pytest")


def nvidia_smi() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not on PATH"}
    query = "name,driver_version,memory.total,memory.used,clocks.max.sm,clocks.max.memory,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return {"error": "nvidia-smi timed out"}
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-500:]}
    return {"gpus": [dict(zip(query.split(","), (v.strip() for v in line.split(","))))
                     for line in out.stdout.strip().splitlines()]}


def run(args) -> dict:
    versions, failed = {}, {}
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            versions[name] = getattr(module, "__version__", getattr(module, "VERSION", "?"))
        except Exception as exc:  # noqa: BLE001 - each failure is reported by name
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    import torch

    cuda = torch.cuda.is_available()
    result = {"python": sys.version.split()[0], "executable": sys.executable, "versions": {k: str(v) for k, v in
                                                                                            versions.items()},
              "import_failures": failed, "cuda_available": cuda, "torch_cuda": torch.version.cuda,
              "nvidia_smi": nvidia_smi() if cuda or not args.dry_run else {"skipped": "dry run without CUDA"}}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        result["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                            "multiprocessors": props.multi_processor_count,
                            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()}
    errors = [f"cannot import {', '.join(failed)}"] if failed else []
    if not cuda and not args.dry_run:
        errors.append("torch sees no CUDA device")
    result["ok"] = not errors
    if errors:
        result["error"] = "; ".join(errors)
    print({k: v for k, v in result.items() if k != "versions"})
    return result


def main(argv: list[str] | None = None) -> int:
    return stage_main(run, argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)


if __name__ == "__main__":
    sys.exit(main())
