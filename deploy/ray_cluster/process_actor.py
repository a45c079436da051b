"""The supervisor actor: one Tandem process on a Ray node, restarted when it exits, dead with the actor.

``tandem ray up`` makes one detached, named actor of this class per process. The actor:

* says where Ray placed it (``where``), so the driver can split each node's cores;
* starts the process (``start``) with the same per-role command line ``tandem up`` uses, logging to
  ``{log_dir}/{name}.log`` on its node, and restarts it when it exits with ``deploy.supervisor``'s
  policy (backoff from 1 s, ``max_restarts`` crashes in a row, then given up), and kills (then restarts) one that
  runs but gives no sign of life for ``watchdog_timeout_s`` (frozen: ``deploy.watchdog``);
* ties the process's life to its own: the process runs with ``TANDEM_DIE_WITH_PARENT``
  (``deploy.parent_guard``), so it gets SIGKILL when the actor dies however it dies;
* stops it on ``stop`` (SIGTERM to its process group: the router drains, workers finish; SIGKILL
  after the wait), and reports ``status``.

When Ray restarts the actor itself (its process or node died; ``was_current_actor_reconstructed``) it
starts its process again at once: on the cores this deployment planned for it when it is back on the same node
(as a tensor-parallel worker's actor is, in its placement group, while the node lives), else unbound (a core
plan made for another node means nothing here). The plan is kept in ``{log_dir}/{name}.cores.json``, with the
count of restarts, which goes on across the actor's own restarts on one node (the process's restart with its
actor counts as one).

Every fork happens on one thread that lives as long as the actor (the kernel ties the parent-death
signal to the forking thread), and that thread alone touches the process; actor methods ask it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import json

import httpx
import yaml

from deploy.local_spawner import CHILD_LOG_LEVEL_ENV
from deploy.process_group import signal_group
from deploy.parent_guard import DIE_WITH_PARENT_ENV
from deploy.ray_cluster.spec import ProcessSpec
from deploy.supervisor import RestartPolicy, Supervisor
from deploy.watchdog import Watchdog
from deploy.zygote_client import ForkedProcess, fork_server_enabled, shared_fork_server
from pipeline.core_list import format_core_list
from pipeline.security import write_private_file

logger = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.2
WORKER_STOP_TIMEOUT_S = 15.0
ROUTER_STOP_MARGIN_S = 5.0  # past drain_timeout_s: uvicorn's own shutdown after the drain
_CONFIG_SECTION = "tandem"
_WILDCARDS = ("0.0.0.0", "::", "[::]")


class ProcessSupervisor:
    """The body of a supervisor actor (``ray.remote`` wraps it in ``deploy.ray_cluster.deployment``)."""

    def __init__(self, spec: ProcessSpec) -> None:
        import ray

        context = ray.get_runtime_context()
        self.spec = spec
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.log_dir = Path(spec.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{spec.name}.log"
        self._watchdog = Watchdog(self.log_dir / f".{spec.name}.alive", spec.watchdog_timeout_s)
        # the fields below, between the supervision thread and methods (reentrant: a restart inside a
        # supervisor step spawns, which takes it again)
        self._lock = threading.RLock()
        self._state = "placed"  # placed -> running <-> restarting -> given_up | stopped | failed
        self._proc: subprocess.Popen | ForkedProcess | None = None
        self._cores: list[int] | None = None
        self._num_restarts = 0
        self._events: deque[str] = deque(maxlen=20)
        self._start_request = threading.Event()
        self._started = threading.Event()  # the first start went through (or failed: _start_error)
        self._start_error: str | None = None
        self._stop_timeout_s: float | None = None  # set (with _stop_request) by stop()
        self._stop_request = threading.Event()
        self._stopped = threading.Event()
        self._supervisor: Supervisor | None = None  # once the process started: the restart policy
        self._thread = threading.Thread(target=self._supervise, name=f"tandem-{spec.name}", daemon=True)
        self._thread.start()
        if context.was_current_actor_reconstructed:
            plan = self._our_plan()
            self._cores = plan.get("cores")
            self._num_restarts = plan.get("restarts", 0) + 1  # the process restarts with its actor (a new node: from 1)
            self._write_plan()
            self._note("Ray restarted this supervisor (its process or node died); starting the process again, " + (
                f"on cores {format_core_list(self._cores)}, planned for this node" if self._cores else
                "not bound to cores (the core plan was made for the node it ran on before)"))
            self._start_request.set()

    # ------------------------------------------------------------ methods
    def where(self) -> dict:
        """Where Ray placed this actor: node id and address, the cores it may use, its GPUs."""
        import ray

        return {"node_id": self.node_id, "node_ip": self.node_ip, "cores": sorted(os.sched_getaffinity(0)),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "actor_pid": os.getpid()}

    def start(self, cores: list[int] | None = None, timeout_s: float = 60.0) -> int:
        """Start the process (bound to ``cores`` when given); returns its pid. Once only."""
        with self._lock:
            if self._start_request.is_set():
                raise RuntimeError(f"{self.spec.name} was already started")
            self._cores = cores
            self._write_plan()
            self._start_request.set()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"{self.spec.name}: the process did not start within {timeout_s:g} s")
        if self._start_error is not None:
            raise RuntimeError(f"{self.spec.name} could not start: {self._start_error}")
        return self._proc.pid

    def status(self) -> dict:
        with self._lock:
            proc = self._proc
            running = proc is not None and proc.poll() is None
            return {
                "deployment": self.spec.deployment, "name": self.spec.name, "role": self.spec.role,
                "state": self._state, "node_ip": self.node_ip, "node_id": self.node_id,
                "pid": proc.pid if running else None, "actor_pid": os.getpid(), "restarts": self._num_restarts,
                "num_ranks": self.spec.num_ranks,
                "cores": format_core_list(self._cores) if self._cores else None, "log": str(self.log_path),
                "last_event": self._events[-1] if self._events else None, "events": list(self._events)[-5:],
                "url": self.url if self.spec.is_router else None,
            }

    @property
    def url(self) -> str:
        """Where clients reach the router (its node's address when it listens on every interface)."""
        host = self.spec.http_host or self.node_ip
        return f"http://{self.node_ip if host in _WILDCARDS else host}:{self.spec.http_port}"

    def router_ready(self) -> dict:
        """The router's ``/ready`` body, asked on its own node (``{"error": ...}`` when unreachable, or when another
        process answers on its port: another deployment's router, while this one cannot bind it; ``port_taken``
        then)."""
        try:
            body = httpx.get(f"{self.url}/ready", timeout=5.0).json()
        except (httpx.HTTPError, ValueError) as exc:
            return {"ready": False, "error": str(exc)}
        with self._lock:
            ours = self._proc.pid if self._proc is not None else None
        if body.get("pid") != ours:
            return {"ready": False, "port_taken": True,
                    "error": f"{self.url} is answered by another router (pid {body.get('pid')}), not this "
                             f"deployment's (pid {ours}): is its port taken?"}
        return body

    def log_tail(self, num_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-num_lines:])

    def replace(self) -> int | None:
        """Rolling restart: SIGTERM the process (it drains: a decode worker hands its streams off) and
        start it again as soon as it exits, a planned exit (no backoff, no crash). Returns the old pid, or
        None when no process runs now."""
        with self._lock:
            proc = self._proc
            if self._supervisor is None or proc is None or proc.poll() is not None:
                return None
            self._supervisor.expect_exit(self.spec.name)
            proc.send_signal(signal.SIGTERM)
            return proc.pid

    def stop(self, timeout_s: float | None = None) -> str:
        """Stop the process for good (no restart): SIGTERM, wait, SIGKILL. Returns the final state."""
        if timeout_s is None:  # a worker stopped while serving (a scale-down) drains first, as the router does
            timeout_s = max(float(self.spec.config.get("drain_timeout_s", 30.0)) + ROUTER_STOP_MARGIN_S,
                            0.0 if self.spec.is_router else WORKER_STOP_TIMEOUT_S)
        self._stop_timeout_s = timeout_s
        self._stop_request.set()
        self._start_request.set()  # wakes a supervision thread still waiting for its start
        self._stopped.wait(timeout_s + 10.0)
        with self._lock:
            return self._state

    @property
    def _key_path(self) -> Path:
        return self.log_dir / f"{self.spec.name}.cluster.key_secret"

    @property
    def _plan_path(self) -> Path:
        return self.log_dir / f"{self.spec.name}.cores.json"

    def _our_plan(self) -> dict:
        """What this deployment recorded for this process on this node (else {}): the cores ``start`` was given and
        the restarts so far, so that an actor Ray restarts goes on with both."""
        try:
            plan = json.loads(self._plan_path.read_text())
        except (OSError, ValueError):
            return {}
        is_ours = self.spec.up_id and plan.get("up_id") == self.spec.up_id and plan.get("node_id") == self.node_id
        return plan if is_ours else {}

    def _write_plan(self) -> None:
        plan = {"up_id": self.spec.up_id, "node_id": self.node_id, "cores": self._cores, "restarts": self._num_restarts}
        self._plan_path.write_text(json.dumps(plan))

    # ------------------------------------------------------- supervision
    def _supervise(self) -> None:
        """The one thread that forks, watches and stops the process."""
        self._start_request.wait()
        if self._stop_request.is_set():
            self._finish("stopped")
            return
        try:
            self._spawn()
        except Exception as exc:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = f"{type(exc).__name__}: {exc}"
            self._finish("failed")
            return
        finally:
            self._started.set()
        with self._lock:
            self._supervisor = supervisor = Supervisor(
                [self.spec.name], RestartPolicy(max_restarts=self.spec.max_restarts),
                poll_exit=lambda _: self._poll_exit(), respawn=lambda _: self._spawn(),
                log_path_of=lambda _: str(self.log_path),
                why_frozen=lambda _: self._watchdog.why_frozen(self._proc.pid),
                kill=lambda _: signal_group(self._proc, signal.SIGKILL))  # a TP worker's ranks with it
        while not self._stop_request.wait(SUPERVISE_INTERVAL_S):
            with self._lock:  # replace() marks an exit as planned between two steps, never inside one
                events = supervisor.step()
            for event in events:
                self._note(event.message)
                with self._lock:
                    if event.kind == "restarted":
                        self._num_restarts += 1
                        self._write_plan()
                    self._state = {"exited": "restarting", "restarted": "running", "given_up": "given_up"}.get(
                        event.kind, self._state)
        self._terminate(self._stop_timeout_s or WORKER_STOP_TIMEOUT_S)
        self._key_path.unlink(missing_ok=True)  # the cluster's secret stays on no node after it stops for good
        self._watchdog.remove()
        self._finish("stopped")

    def _poll_exit(self) -> int | None:
        returncode = self._proc.poll()
        if returncode is not None:
            self._watchdog.forget(self._proc.pid)
        return returncode

    def _spawn(self) -> int:
        """Start (or restart) the process; its log is appended to across restarts."""
        config = dict(self.spec.config)
        if not self.spec.is_router and config.get("zmq_endpoint_base", "").startswith("tcp://"):
            config.setdefault("bind_host", self.node_ip)  # peers on other nodes reach it here
        if self.spec.cluster_key:
            key_path = write_private_file(self._key_path, self.spec.cluster_key)
            config["security"] = {**config.get("security", {}), "cluster_key_file": str(key_path)}
        config_path = self.log_dir / f"{self.spec.name}.config.yaml"
        config_path.write_text(yaml.safe_dump({_CONFIG_SECTION: config}))
        log_level = self.spec.env.get(CHILD_LOG_LEVEL_ENV, "INFO")
        argv = [sys.executable, "-m", "deploy.cli", "--log-level", log_level, *self.spec.cli_args(self.node_ip),
                "--config", str(config_path), "--section", _CONFIG_SECTION]
        if self._cores:
            argv += ["--cpu-cores", format_core_list(self._cores)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env, **self._watchdog.env(),
               DIE_WITH_PARENT_ENV: str(os.getpid())}
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} tandem ray: starting {self.spec.name}: "
                      f"{' '.join(argv[1:])} =====\n".encode())
            log.flush()
            if not self.spec.is_router and fork_server_enabled():  # restarts fork warm (deploy.zygote)
                server = shared_fork_server(self.log_dir / f"{self.spec.name}.zygote.log")
                proc = server.spawn("deploy.cli", argv[3:], env, self.log_path, cwd=str(self.log_dir))
            else:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, cwd=self.log_dir, start_new_session=True)
        with self._lock:
            self._proc = proc
            self._state = "running"
        return proc.pid

    def _terminate(self, timeout_s: float) -> None:
        """SIGTERM the process group, wait up to ``timeout_s``, SIGKILL what is left."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._note(f"{self.spec.name} did not stop within {timeout_s:g} s; killing it")
            signal_group(proc, signal.SIGKILL)
            proc.wait(10)

    def _finish(self, state: str) -> None:
        with self._lock:
            self._state = state
        self._stopped.set()

    def _note(self, message: str) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        with self._lock:
            self._events.append(stamped)
        logger.warning("%s", message)
        try:
            with open(self.log_dir / "supervisor.log", "a") as log:
                log.write(stamped + "\n")
        except OSError:
            pass

