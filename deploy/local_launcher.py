"""LocalCluster: the router and N prefill / M decode / K colocated workers as processes on this host.

Each process runs in its own process group (so a Ctrl-C in the terminal reaches the launcher, which
then shuts every child down in order) and logs to a file of its own. All sockets derive from one
``zmq_endpoint_base`` (a fresh ``ipc://`` path by default, so clusters never collide).
``tests/`` uses the same class as its cluster fixture.

Workers are forked from a fork server (``deploy.zygote``) that imported torch and transformers once, so
a worker, first start or restart, begins serving in about a second instead of paying those imports
again; the router (which never loads torch) is exec'd by one thread that lives until ``stop()`` has
ended it and asks for SIGKILL when the launcher dies (``deploy.parent_guard``; the kernel ties that
signal to the forking thread, which is why no other thread forks). The fork server's children get
SIGKILL when it dies, and it kills them itself when the launcher goes (its socket closes): a launcher
killed with SIGKILL (or a benchmark or test run cut short) leaves no process behind. ``TANDEM_ZYGOTE=0``
exec's every process afresh instead.

The router serves from its first ``/ready`` 200; from that moment a background thread applies
``deploy.supervisor``'s restart policy (a worker that dies while ``start()`` still waits for the others
is restarted, never a start-up failure): a process that exits is started again (same command, its log
appended to) until it crashes ``max_restarts`` times in a row; a process that runs but gives no sign of
life for ``watchdog_timeout_s`` (frozen: ``deploy.watchdog``) is killed and restarted the same way. An exited
process's shared-memory KV cache is removed as soon as its exit is seen, and every started process's at ``stop()``.
Restarted workers re-register with the router by themselves. What the cluster keeps on disk (its work dir,
config file, generated cluster key, socket files) is ``deploy.cluster_files``'; ``stop()`` leaves only the logs. Every supervision event goes to
``on_event`` (``tandem up`` prints it; default: this module's logger) and to ``launcher.log``.
``failure`` says why the cluster cannot serve any more (router or every decode-capable worker given up).
With a ``cpu_plan`` (``deploy.cpu_plan``) each worker is started bound to its own cores, and the
router to ``router_cores``. A worker with ``tensor_parallel_size`` N is one supervised process, rank 0, which
starts ranks 1..N-1 itself and exits when one of them dies; a restart starts all N again.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from deploy.cluster_files import ClusterFiles
from deploy.keygen_cmd import API_KEY_ENV
from deploy.local_spawner import ProcessSpawner
from deploy.process_group import signal_group, terminate_groups
from deploy.supervisor import RestartPolicy, Supervisor, SupervisorEvent
from deploy.watchdog import Watchdog
from deploy.zygote_client import ForkedProcess, fork_server_enabled
from kv_transfer.shm_files import remove_shared_kv_files_of
from pipeline.config import PipelineConfig
from pipeline.core_list import format_core_list

logger = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.2
ROUTER_STOP_MARGIN_S = 5.0  # past drain_timeout_s: uvicorn's own shutdown after the drain


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or become ready; the message holds its log tail."""


@dataclass
class LocalCluster:
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    config: dict = field(default_factory=dict)  # PipelineConfig overrides shared by every process
    api_key: str | None = None  # the router's --api-key: KEY, KEY1,KEY2 or @FILE
    # With ssl_certfile: the router serves HTTPS (the launcher's own /ready polls skip verifying it: they
    # read only readiness, from the router it started, whose certificate may name another host)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    router_options: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    # 0: a process that exits stays down (the test fixture's choice: fault tests kill on purpose).
    max_restarts: int = 0
    # a running process silent this long (SIGSTOP, a held GIL, a wedged event loop) is killed, then restarted; 0: off
    watchdog_timeout_s: float = 30.0
    on_event: Callable[[SupervisorEvent], None] | None = None  # called from the supervision thread
    entry_module: str = "deploy.cli"  # what ``python -m`` runs in each process (tests swap in a wrapper)
    env: dict[str, str] = field(default_factory=dict)  # set in every process's environment, over ours
    # {worker name: cores}: each worker gets "--cpu-cores" (deploy.cpu_plan); None: no binding
    cpu_plan: dict[str, list[int]] | None = None
    router_cores: list[int] | None = None  # the router's "--cpu-cores" (deploy.cpu_plan.router_cores); None: unbound
    # {worker name: tensor_parallel_size} over the shared config's (deploy.tensor_parallel_plan): N rank processes,
    # which start (and a restart starts again) with their worker, rank 0
    tensor_parallel_sizes: dict[str, int] = field(default_factory=dict)
    # Workers forked from a warm fork server (deploy.zygote), unless TANDEM_ZYGOTE=0 or not on Linux
    use_fork_server: bool = field(default_factory=fork_server_enabled)
    processes: dict[str, subprocess.Popen | ForkedProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.restart_policy = RestartPolicy(max_restarts=self.max_restarts)
        self._lock = threading.Lock()  # processes and spawning: the supervision thread vs stop() and kill()
        self._is_stopping = threading.Event()
        self._is_forced = threading.Event()  # stop without waiting: the user asked twice
        self._supervisor: Supervisor | None = None
        self._supervision_thread: threading.Thread | None = None
        self._files = ClusterFiles()
        self.started_pids: set[int] = set()  # every process this cluster ever started (restarts included)
        self.log_dir = Path(self.log_dir) if self.log_dir else self._files.default_log_dir
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # nothing started yet: nothing of this cluster stays behind
            self._files.remove("")
            raise ValueError(f"--log-dir {self.log_dir}: cannot be created ({exc.strerror})") from None
        self.watchdog = Watchdog(self._files.watchdog_dir, self.watchdog_timeout_s)
        self.spawner = ProcessSpawner(self.log_dir, self.entry_module, {**self.env, **self.watchdog.env()},
                                      self.use_fork_server)
        self.config = dict(self.config)
        self.config.setdefault("zmq_endpoint_base", self._files.default_endpoint_base)
        if self.model_path is not None:
            self.config.setdefault("model", {})["model_path"] = str(self.model_path)
        self._files.add_cluster_key(self.config)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_certfile else 'http'}://{self.host}:{self.port}"

    @property
    def worker_names(self) -> list[str]:
        return worker_names(self.num_prefill, self.num_decode, self.num_colocated)

    @property
    def pids(self) -> dict[str, int]:
        """{process name: pid of its current incarnation}."""
        with self._lock:
            return {name: proc.pid for name, proc in self.processes.items()}

    @property
    def failure(self) -> str | None:
        """Why the cluster cannot serve any more (processes given up); None while it can."""
        return self._supervisor.failure if self._supervisor else None

    def log_path(self, name: str) -> Path:
        return self.spawner.log_path(name)

    # --------------------------------------------------------------- control
    def start(self, timeout_s: float = 180.0) -> "LocalCluster":
        if self.num_decode + self.num_colocated == 0:
            raise ClusterError("a cluster needs at least one decode or colocated worker")
        unplanned = sorted(set(self.worker_names) - set(self.cpu_plan)) if self.cpu_plan is not None else []
        if unplanned:
            raise ClusterError(f"cpu_plan has no cores for {unplanned}")
        if self.num_decode and not self.num_prefill:
            logger.warning("decode workers without prefill workers prefill locally (colocated fallback)")
        if self.config.get("model", {}).get("model_path") is None:
            from pipeline.builtin_model import builtin_model_path  # build once here, not in every child

            builtin_model_path()
        common = self._files.write_config(self.config)
        router_args = ["router", "--host", self.host, "--port", str(self.port), *self.router_options]
        # the API key in the router's environment, which its --api-key defaults to: argv is readable by every user
        router_env = {API_KEY_ENV: self.api_key} if self.api_key else None
        if self.ssl_certfile:
            router_args += ["--ssl-keyfile", str(self.ssl_keyfile), "--ssl-certfile", str(self.ssl_certfile)]
        if self.router_cores:
            router_args += ["--cpu-cores", format_core_list(self.router_cores)]
        try:
            if self.use_fork_server and self.worker_names:
                self.spawner.start_fork_server()
            self._spawn("router", router_args + common, router_env)
            roles = {"prefill": "PrefillOnly", "decode": "DecodeOnly", "colocated": "PrefillAndDecode"}
            for name in self.worker_names:
                role = roles[name.split("-")[0]]
                placement = ["--cpu-cores", format_core_list(self.cpu_plan[name])] if self.cpu_plan else []
                if name in self.tensor_parallel_sizes:
                    placement += ["--tensor-parallel-size", str(self.tensor_parallel_sizes[name])]
                self._spawn(name, ["worker", "--role", role, "--worker-id", name, *common, *placement])
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str] | None = None, env: dict[str, str] | None = None) -> int:
        """Start ``name`` with ``args`` and its own ``env`` (None: a restart, as it was last started)."""
        proc = self.spawner.spawn(name, args, env) if args is not None else self.spawner.respawn(name)
        self.processes[name] = proc
        self.started_pids.add(proc.pid)
        self._log_event(f"{name} started as pid {proc.pid}")
        return proc.pid

    # ----------------------------------------------------------- supervision
    def _start_supervision(self) -> None:
        self._supervisor = Supervisor(
            list(self.processes), self.restart_policy,
            poll_exit=self._poll_exit,
            respawn=self._spawn,
            why_cannot_serve=_why_cannot_serve, log_path_of=lambda name: str(self.log_path(name)),
            why_frozen=lambda name: self.watchdog.why_frozen(self.processes[name].pid),
            kill=lambda name: signal_group(self.processes[name], signal.SIGKILL),  # a TP worker's ranks too
        )
        self._supervision_thread = threading.Thread(target=self._supervise, name="tandem-supervisor", daemon=True)
        self._supervision_thread.start()

    def _poll_exit(self, name: str) -> int | None:
        """``name``'s exit code (None while it runs); an exited process's shared KV cache is removed at
        once: one killed by a signal could not remove it, and a crash loop would fill memory."""
        proc = self.processes[name]
        returncode = proc.poll()
        if returncode is not None:
            remove_shared_kv_files_of({proc.pid})
            self.watchdog.forget(proc.pid)
        return returncode

    def _supervise(self) -> None:
        while not self._is_stopping.wait(SUPERVISE_INTERVAL_S):
            with self._lock:
                if self._is_stopping.is_set():  # stop() began while we waited for the lock: restart nothing
                    return
                events = self._supervisor.step()
            for event in events:
                try:
                    self._report(event)
                except Exception:  # noqa: BLE001 - a failed report must not end supervision
                    logger.exception("could not report: %s", event.message)

    def _log_event(self, message: str) -> None:
        with open(self.log_dir / "launcher.log", "a") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    def _report(self, event: SupervisorEvent) -> None:
        self._log_event(event.message)
        if self.on_event is not None:
            self.on_event(event)
        else:
            logger.warning("%s", event.message)

    def _stop_supervision(self) -> None:
        self._is_stopping.set()
        with self._lock:  # waits for a step in progress, so no restart can follow
            pass
        if self._supervision_thread is not None and self._supervision_thread is not threading.current_thread():
            self._supervision_thread.join(timeout=5)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router reports ready with every worker alive.

        Two phases, split at the moment the router first answers ``/ready`` 200 (it serves from then on):
        before it, a process that exits is a start-up failure (``ClusterError`` with its log tail, fast);
        from it on, supervision runs, so a process that exits is restarted like any later crash and
        the wait goes on for the new process. Only a cluster that can no longer serve fails then."""
        deadline = time.monotonic() + timeout_s
        expected = set(self.worker_names)
        while time.monotonic() < deadline:
            body = self._ready_body()
            if self._supervisor is None:
                if body is not None and body.get("ready"):
                    self._start_supervision()  # the router serves: every death is a restart from now on
                else:
                    exited = [(name, proc) for name, proc in self.processes.items() if proc.poll() is not None]
                    if exited and not self._router_serves():  # ready meanwhile: supervision restarts it
                        name, proc = exited[0]
                        remove_shared_kv_files_of({proc.pid})
                        raise ClusterError(f"{name} exited with code {proc.returncode}:\n{self.log_tail(name)}")
                    if exited:
                        self._start_supervision()
            elif self.failure is not None:
                raise ClusterError(f"the cluster cannot serve: {self.failure}; logs in {self.log_dir}")
            if body is not None and body.get("ready"):
                alive = {w["worker_id"] for w in body.get("workers", []) if w.get("alive")}
                if expected <= alive | (self._supervisor.given_up if self._supervisor else set()):
                    return
            time.sleep(0.05)
        raise ClusterError(f"cluster not ready after {timeout_s:.0f}s; logs in {self.log_dir}")

    def _ready_body(self) -> dict | None:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2.0, verify=False).json()
        except (httpx.HTTPError, ValueError):
            return None

    def _router_serves(self) -> bool:
        body = self._ready_body()
        return bool(body and body.get("ready"))

    def rolling_restart(self, names: list[str] | None = None, ready_timeout_s: float = 120.0) -> None:
        """Replace workers one at a time (default: every worker, prefill first) with no failed request:
        each gets SIGTERM and drains (the router stops routing to it; what it runs finishes within
        ``drain_timeout_s``, and streams still running then migrate to another worker), exits, and is
        started again at once; the next one goes only when the router has the new process alive.
        The new processes read the same command and config file again, so a checkpoint or config
        changed on disk is picked up."""
        if self._supervisor is None:
            raise ClusterError("the cluster is not running")
        for name in names or self.worker_names:
            with self._lock:
                old = self.processes[name]
                self._supervisor.expect_exit(name)
                old.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self._drain_timeout_s() + ROUTER_STOP_MARGIN_S
            while self.processes[name] is old:  # the supervision thread starts the new one once it exits
                if time.monotonic() > deadline and old.poll() is None:
                    old.kill()  # stuck past its drain: it would be killed on a stop too
                if self._is_stopping.is_set():
                    return
                time.sleep(0.05)
            self._wait_alive(name, self.processes[name].pid, ready_timeout_s)

    def _wait_alive(self, name: str, pid: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                workers = httpx.get(f"{self.url}/ready", timeout=2.0, verify=False).json().get("workers", [])
                if any(w["worker_id"] == name and w["alive"] and w.get("pid") == pid for w in workers):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.processes[name].poll() is not None and self.processes[name].pid == pid:
                raise ClusterError(f"{name} exited while starting:\n{self.log_tail(name)}")
            time.sleep(0.1)
        raise ClusterError(f"{name} (pid {pid}) did not register within {timeout_s:.0f}s; logs in {self.log_dir}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process of this cluster (fault tests)."""
        with self._lock:
            self.processes[name].send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Drain, then stop: supervision off; the router first (SIGTERM: it stops accepting and lets
        in-flight requests finish within ``drain_timeout_s``, which needs the workers still up); then
        the workers (SIGTERM); SIGKILL for any process still running after its wait.

        Workers get ``timeout_s``, not another full drain: once the router is gone nothing they still
        run has a client to go to."""
        self._stop_supervision()
        with self._lock:
            workers = dict(self.processes)
        router = workers.pop("router", None)
        try:
            if router is not None:
                terminate_groups({"router": router}, self._drain_timeout_s() + ROUTER_STOP_MARGIN_S, self._is_forced)
        finally:  # whatever went wrong above, no worker may outlive the cluster
            terminate_groups(workers, timeout_s, self._is_forced)
        with self._lock:
            self.processes.clear()
        self.spawner.close()  # every process has ended: its forking thread may go
        self._files.remove(str(self.config["zmq_endpoint_base"]))  # all but the logs
        remove_shared_kv_files_of(self.started_pids)  # shared KV caches of workers that had to be killed

    def force_stop(self) -> None:
        """Cut a ``stop()`` in progress short (from another thread or a signal handler): whatever
        still runs gets SIGKILL now instead of its drain."""
        self._is_forced.set()

    def _drain_timeout_s(self) -> float:
        return float(self.config.get("drain_timeout_s", PipelineConfig.model_fields["drain_timeout_s"].default))

    def log_tail(self, name: str, num_lines: int = 40) -> str:
        path = self.log_path(name)
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def worker_names(num_prefill: int, num_decode: int, num_colocated: int) -> list[str]:
    """Every worker's name, which is also its worker id: "prefill-0", ..., "decode-0", ..., "colocated-0", ..."""
    return ([f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
            + [f"colocated-{i}" for i in range(num_colocated)])


def _why_cannot_serve(names_left: set[str]) -> str | None:
    """The cluster needs its router and at least one worker that decodes (a decode worker prefills
    locally when no prefill worker is left)."""
    if "router" not in names_left:
        return "the router is down for good"
    if not any(name.startswith(("decode-", "colocated-")) for name in names_left):
        return "no decode or colocated worker is left"
    return None
