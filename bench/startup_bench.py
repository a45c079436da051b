"""How fast a cluster starts and a killed worker serves again: ``tandem up --prefill 1 --decode 1`` as a
user runs it, timed from the command to the first answered request, and from a SIGKILL of the decode
worker to its new incarnation answering, with the fork server (default) and without (``TANDEM_ZYGOTE=0``).

    python -m bench.startup_bench --repeats 3 --out bench/results/startup.json

Each start is a fresh ``tandem up`` process (its fork server starts with it); the first start of the
run warms the page cache and the built-in checkpoint and is reported apart ("cold"). Run it with the
virtualenv ``make run`` builds for the numbers a user sees: transformers' import scans every installed
distribution's metadata, so a venv with the test extras (several hundred packages) starts slower.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        out = httpx.post(f"{url}/v1/completions", json={"model": "tandem-builtin", "prompt": "Hi", "max_tokens": 2},
                         timeout=5)
        return out.status_code == 200
    except httpx.HTTPError:
        return False


def _decode_pid(url: str) -> int | None:
    try:
        workers = httpx.get(f"{url}/ready", timeout=2).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return None
    return next((w["pid"] for w in workers if w["worker_id"] == "decode-0" and w["alive"]), None)


def one_run(use_fork_server: bool, timeout_s: float = 300.0) -> dict:
    """One ``tandem up``: seconds to the first answer, and from killing decode-0 to its successor answering."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TANDEM_ZYGOTE": "1" if use_fork_server else "0"}
    log_dir = tempfile.mkdtemp(prefix="tandem-startup-")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--prefill", "1", "--decode", "1",
                             "--port", str(port), "--log-dir", log_dir], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not _answers(url):
            if time.monotonic() - started > timeout_s or proc.poll() is not None:
                raise RuntimeError(f"tandem up did not serve in {timeout_s:.0f}s; logs in {log_dir}")
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        old_pid = _decode_pid(url)
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        while True:  # the new incarnation registered and a request it must serve (the only decoder) answers
            pid = _decode_pid(url)
            if pid is not None and pid != old_pid and _answers(url):
                break
            if time.monotonic() - killed > timeout_s:
                raise RuntimeError(f"decode-0 did not come back in {timeout_s:.0f}s; logs in {log_dir}")
            time.sleep(0.02)
        restart_s = time.monotonic() - killed
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return {"ready_s": ready_s, "killed_worker_serving_again_s": restart_s}


def cpu_description() -> dict:
    info = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        info["model"] = fields.get("Model name", "").strip()
        info["flags"] = " ".join(f for f in fields.get("Flags", "").split()
                                 if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/startup.json")
    args = parser.parse_args()
    cold = one_run(use_fork_server=True)
    results = {"benchmark": "startup", "cpu": cpu_description(), "cold_first_start": cold, "runs": {}}
    for label, use_fork_server in (("fork_server", True), ("exec_each_process", False)):
        runs = [one_run(use_fork_server) for _ in range(args.repeats)]
        results["runs"][label] = {
            "runs": runs,
            "median_ready_s": statistics.median(r["ready_s"] for r in runs),
            "median_killed_worker_serving_again_s": statistics.median(r["killed_worker_serving_again_s"] for r in runs),
        }
        print(f"{label}: ready {results['runs'][label]['median_ready_s']:.2f} s, killed worker serving again "
              f"{results['runs'][label]['median_killed_worker_serving_again_s']:.2f} s (medians of {args.repeats})",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    try:
        from bench.plot import render
    except ImportError:  # the venv `make run` builds has no matplotlib: the JSON is the result
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
        return
    render(results, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
