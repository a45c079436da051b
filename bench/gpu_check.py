"""``make gpu-check``: Tandem's GPU path checked on one lent GPU by one command (docs/gpu.md).

    python3 -m bench.gpu_check [--dry-run] [--out DIR] [--only STAGE,...] [--budget-s 420]

Stages, each in a process of its own with its own timeout, every one run whatever the others did (a
stage that would start with too little of the whole run's budget left is recorded as skipped):

1. ``wheels``: the carried ``.whl/`` checked against ``deploy/gpu_wheels.txt`` and installed into this
   Python (``pip install --no-index --find-links .whl``: nothing fetched, torch and triton untouched);
2. ``environment``: device, driver, versions, every dependency importable (``bench.gpu_check_env``);
3. ``pytest_gpu``: ``pytest -m gpu`` over the files outside ``tests/kernels`` that carry the marker
   (``tests/gpu``: the engine on CUDA against transformers on CUDA);
4. ``pytest_kernels``: every test of ``tests/kernels`` with compiled kernels on the GPU
   (``TRITON_INTERPRET=0``: each triton kernel against its torch reference, the ``gpu`` tests included);
5. ``pd_cluster``: a 1 prefill + 1 decode cluster sharing the GPU, greedy completions against the
   colocated engine, KV blocks back (``bench.gpu_check_cluster``);
6. ``kernel_numbers``, ``kv_transfer``, ``offline_throughput``: the numbers (``bench.gpu_check_numbers``).

``--dry-run`` runs the same stages on the CPU in a reduced form (the tiny model, tiny shapes); what needs
CUDA is recorded as "skipped: no CUDA". The report, ``$OUT/gpu-check.json`` (``$OUT`` unset:
``./gpu-check-out``), has the same shape either way; ``gpu-check.log`` beside it holds every stage's
output. This module imports nothing outside the standard library: it runs before the wheels are in.
Exit status: 0 when no stage failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = REPO_ROOT / "deploy" / "gpu_wheels.txt"
WHEEL_DIR = REPO_ROOT / ".whl"
MAX_WHEEL_BYTES = 64 * 2**20  # what the device tool carries in one call, the working tree included
REPORT_NAME, LOG_NAME = "gpu-check.json", "gpu-check.log"


@dataclass(frozen=True)
class Stage:
    name: str
    timeout_s: float
    needs_cuda: bool = False  # skipped in a dry run
    what: str = ""


STAGES = (
    Stage("wheels", 90, what="carried wheels checked and installed"),
    Stage("environment", 60, what="device, versions, imports"),
    Stage("pytest_gpu", 120, what="pytest -m gpu outside tests/kernels (engine on CUDA vs transformers)"),
    Stage("pytest_kernels", 150, needs_cuda=True, what="tests/kernels compiled on the GPU (TRITON_INTERPRET=0)"),
    Stage("pd_cluster", 150, what="1P1D cluster on one device vs colocated, blocks back"),
    Stage("kernel_numbers", 90, what="decode attention GB/s vs HBM, prefill GEMM TFLOP/s vs bf16 peak"),
    Stage("kv_transfer", 60, what="KV transfer GB/s between two processes"),
    Stage("offline_throughput", 150, what="offline tok/s, 1.1B shape bf16, vs transformers generate"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


# ----------------------------------------------------------------------------- wheels
def wheel_requirements(path: Path = WHEEL_LIST) -> list[tuple[str, str]]:
    """(normalised name, requirement line) for every requirement in ``deploy/gpu_wheels.txt``."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]
            out.append((normalise(name), line))
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_wheel_dir(wheel_dir: Path = WHEEL_DIR) -> dict:
    """Which listed wheels ``wheel_dir`` holds (one each, for CPython 3.12 on x86-64 Linux) and its size."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    by_name: dict[str, list[str]] = {}
    for wheel in wheels:
        by_name.setdefault(normalise(wheel.name.split("-")[0]), []).append(wheel.name)
    problems = []
    for name, line in wheel_requirements():
        found = by_name.get(name, [])
        if len(found) != 1:
            problems.append(f"{line}: {len(found)} wheels in {wheel_dir.name}/ ({', '.join(found) or 'none'})")
    for wheel in wheels:
        tags = wheel.name[:-4].split("-")[-3:]  # python, abi, platform
        if not (tags[0] in ("py3", "cp312") or tags[1] == "abi3") or not (tags[2] == "any" or "x86_64" in tags[2]):
            problems.append(f"{wheel.name}: not for CPython 3.12 on x86-64 Linux")
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_WHEEL_BYTES:
        problems.append(f"{total / 2**20:.1f} MiB of wheels: over the 64 MiB a device call carries")
    return {"wheel_dir": str(wheel_dir), "num_wheels": len(wheels), "mib": round(total / 2**20, 2),
            "wheels": [w.name for w in wheels], "problems": problems}


# ----------------------------------------------------------------------------- running a stage
class Runner:
    def __init__(self, out_dir: Path, dry_run: bool, budget_s: float, log, scratch: Path) -> None:
        """``scratch``: where stage outputs and results are written first (its owner removes it)."""
        self.out_dir, self.dry_run, self.budget_s, self.log = out_dir, dry_run, budget_s, log
        self.start = time.monotonic()
        self.tmp = scratch
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}

    def remaining_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def note(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()

    def command(self, argv: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
        """Run ``argv`` in its own process group, output to the log; (return code or None on timeout, tail)."""
        self.note(f"$ {' '.join(argv)}  (timeout {timeout_s:.0f} s)")
        out_path = self.tmp / f"out-{time.monotonic_ns()}.txt"
        with open(out_path, "w+b") as out:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env or self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
                _stop_group(proc)
            out.seek(0)
            text = out.read().decode(errors="replace")
        self.log.write(text if text.endswith("\n") or not text else text + "\n")
        self.log.flush()
        return code, "\n".join(text.splitlines()[-25:])

    def stage_script(self, module: str, extra: list[str], timeout_s: float) -> tuple[int | None, str, dict]:
        """A stage module's ``main`` (``--result FILE``): (return code, output tail, the result it wrote)."""
        result_path = self.tmp / f"{module}-{time.monotonic_ns()}.json"
        argv = [sys.executable, "-m", module, "--result", str(result_path), *extra]
        if self.dry_run:
            argv.append("--dry-run")
        code, tail = self.command(argv, timeout_s)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        return code, tail, result


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the stage's process group (stage modules stop what they started), SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_wheels(runner: Runner, timeout_s: float) -> dict:
    carried = check_wheel_dir()
    if runner.dry_run:
        if not carried["num_wheels"]:
            return {"status": "skipped", "reason": "dry run: .whl/ is empty (make gpu-wheels fills it)", **carried}
        status = "failed" if carried["problems"] else "passed"
        return {"status": status, "reason": "; ".join(carried["problems"]) or
                "dry run: wheels checked against deploy/gpu_wheels.txt, not installed (this Python has its own)",
                **carried}
    if sys.version_info[:2] != (3, 12):  # never install cp312 wheels into another Python (a dev machine's venv)
        reason = (f"the carried wheels are for CPython 3.12, this is {platform.python_version()}: not installed "
                  "(without a GPU, run --dry-run)")
        return {"status": "failed", "reason": reason, **carried}
    if carried["problems"]:
        runner.note("wheel problems: " + "; ".join(carried["problems"]))
    argv = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(WHEEL_DIR), "--no-cache-dir",
            "--disable-pip-version-check", "-r", str(WHEEL_LIST)]
    code, tail = runner.command(argv, timeout_s)
    ok = code == 0
    return {"status": "passed" if ok else "failed", "returncode": code,
            "reason": "" if ok else ("timed out" if code is None else tail[-1500:]), **carried}


def pytest_stage(runner: Runner, name: str, paths: list[str], marker: str, timeout_s: float, env: dict) -> dict:
    if not [p for p in paths if not p.startswith("-")]:
        return {"status": "failed", "reason": "no test file carries the marker"}
    junit = runner.out_dir / f"{name.replace('_', '-')}.xml"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", "-m", marker,
            f"--junitxml={junit}", "-o", "junit_logging=no", *paths]
    code, tail = runner.command(argv, timeout_s, env=env)
    result = junit_summary(junit) if junit.exists() else {}
    ok = code == 0 and result.get("failed", 0) == 0 and result.get("errors", 0) == 0
    reason = "" if ok else ("timed out" if code is None else f"pytest exit {code}: {tail[-1500:]}")
    return {"status": "passed" if ok else "failed", "returncode": code, "reason": reason, **result}


def junit_summary(path: Path) -> dict:
    """Every test's outcome, time and message (and properties it recorded) from a JUnit XML report."""
    tests, counts = [], {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, (node.get("message") or node.text or "")[:400]
                break
        counts[outcome] += 1
        entry = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                 "seconds": round(float(case.get("time") or 0), 2)}
        if message:
            entry["message"] = message
        props = {p.get("name"): _number(p.get("value")) for p in case.iter("property")}
        if props:
            entry["properties"] = props
        tests.append(entry)
    return {**counts, "tests": tests}


def _number(value: str | None):
    try:
        return json.loads(value) if value is not None else None
    except ValueError:
        return value


def marked_test_files(marker: str = "gpu", exclude: str = "tests/kernels/") -> list[str]:
    """Test files that carry ``pytest.mark.<marker>`` (outside ``exclude``), relative to the repo."""
    pattern = re.compile(rf"pytest\.mark\.{marker}\b")
    files = []
    for path in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if not rel.startswith(exclude) and pattern.search(path.read_text(errors="replace")):
            files.append(rel)
    return files


def run_stage(runner: Runner, stage: Stage, selected: set[str], cuda: bool | None) -> dict:
    started = time.monotonic()
    timeout_s = min(stage.timeout_s, runner.remaining_s() - 5)
    base = {"name": stage.name, "what": stage.what, "timeout_s": round(max(timeout_s, 0), 1)}
    if stage.name not in selected:
        return {**base, "status": "skipped", "reason": "not selected (--only)", "seconds": 0.0}
    if stage.needs_cuda and runner.dry_run:
        return {**base, "status": "skipped", "reason": "skipped: no CUDA (dry run)", "seconds": 0.0}
    if timeout_s < 15:
        reason = f"out of the run's {runner.budget_s:.0f} s budget"
        return {**base, "status": "skipped", "reason": reason, "seconds": 0.0}
    if cuda is False and not runner.dry_run and stage.name != "wheels":
        return {**base, "status": "failed", "reason": "no CUDA device visible (see environment)", "seconds": 0.0}
    runner.note(f"\n===== {stage.name}: {stage.what} =====")
    device = "cpu" if runner.dry_run else "cuda"
    if stage.name == "wheels":
        outcome = run_wheels(runner, timeout_s)
    elif stage.name in ("pytest_gpu", "pytest_kernels"):
        env = dict(runner.env)
        if stage.name == "pytest_kernels":
            env["TRITON_INTERPRET"] = "0"
            # pytest-xdist (in the device image): triton's compiles, CPU-bound, spread over 4 processes
            parallel = ["-n", "4"] if importlib.util.find_spec("xdist") else []
            outcome = pytest_stage(runner, stage.name, [*parallel, "tests/kernels"], "not slow", timeout_s, env)
        else:
            outcome = pytest_stage(runner, stage.name, marked_test_files(), "gpu", timeout_s, env)
    else:
        module, extra = {
            "environment": ("bench.gpu_check_env", []),
            "pd_cluster": ("bench.gpu_check_cluster", ["--device", device]),
            "kernel_numbers": ("bench.gpu_check_numbers", ["kernels", "--device", device]),
            "kv_transfer": ("bench.gpu_check_numbers", ["kv-transfer", "--device", device]),
            "offline_throughput": ("bench.gpu_check_numbers", ["offline", "--device", device]),
        }[stage.name]
        code, tail, result = runner.stage_script(module, extra, timeout_s)
        ok = code == 0 and result.get("ok", False)
        reason = "" if ok else ("timed out" if code is None else result.get("error") or f"exit {code}: {tail[-1500:]}")
        outcome = {"status": "passed" if ok else "failed", "returncode": code, "reason": reason, "result": result}
    return {**base, **outcome, "seconds": round(time.monotonic() - started, 1)}


def stage_main(body, parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """A stage module's entry: ``body(args)`` -> result dict (``ok`` in it), written to ``--result``; an
    exception is a failed result with its traceback's end; SIGTERM (the stage's timeout) unwinds, so
    ``finally`` blocks stop what the stage started."""
    import traceback

    parser.add_argument("--result", required=True, help="where the result JSON goes")
    parser.add_argument("--dry-run", action="store_true", help="the reduced CPU form")
    args = parser.parse_args(argv)

    def on_sigterm(*_):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = body(args)
    except BaseException as exc:  # noqa: BLE001 - recorded, and the runner goes on with the next stage
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                  "traceback": traceback.format_exc()[-3000:]}
    Path(args.result).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the reduced CPU run (no CUDA needed)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="report folder ($OUT)")
    parser.add_argument("--only", default=",".join(STAGE_NAMES), help=f"stages to run, of {','.join(STAGE_NAMES)}")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's wall-clock budget")
    args = parser.parse_args(argv)
    selected = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = selected - set(STAGE_NAMES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGE_NAMES)}")
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"check": "gpu-check", "mode": "dry-run" if args.dry_run else "gpu",
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
              "python": sys.version.split()[0], "command": " ".join([Path(sys.executable).name, "-m", "bench.gpu_check",
                                                                     *(argv if argv is not None else sys.argv[1:])]),
              "budget_s": args.budget_s, "environment": {}, "stages": []}
    with open(out_dir / LOG_NAME, "w") as log, tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        runner = Runner(out_dir, args.dry_run, args.budget_s, log, Path(scratch))
        cuda: bool | None = None
        for stage in STAGES:
            outcome = run_stage(runner, stage, selected, cuda)
            if stage.name == "environment" and outcome.get("result"):
                report["environment"] = outcome.pop("result")
                cuda = report["environment"].get("cuda_available")
            report["stages"].append(outcome)
            print(f"{stage.name:20s} {outcome['status']:8s} {outcome['seconds']:6.1f} s  "
                  f"{_short(outcome.get('reason', ''))}", flush=True)
            _write(out_dir, report, runner)
    _write(out_dir, report, runner)
    summary = report["summary"]
    print(f"gpu-check ({report['mode']}): {summary['passed']} passed, {summary['failed']} failed, "
          f"{summary['skipped']} skipped in {report['wall_s']} s; report {out_dir / REPORT_NAME}")
    return 0 if summary["failed"] == 0 else 1


def _short(text: str) -> str:
    return " ".join(str(text).split())[:150]


def _write(out_dir: Path, report: dict, runner: Runner) -> None:
    statuses = [s["status"] for s in report["stages"]]
    report["summary"] = {k: statuses.count(k) for k in ("passed", "failed", "skipped")}
    report["summary"]["ok"] = report["summary"]["failed"] == 0
    report["wall_s"] = round(time.monotonic() - runner.start, 1)
    tmp = out_dir / (REPORT_NAME + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out_dir / REPORT_NAME)


if __name__ == "__main__":
    sys.exit(main())
