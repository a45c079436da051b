"""The fork server (zygote): one process that imports the heavy libraries once and forks workers from
that warm state, so a new or restarted worker starts in well under a second instead of paying torch's
and transformers' import chain (about 8 s of CPU on a 2-core host) every time.

Run as ``python -m deploy.zygote FD`` by ``deploy.zygote_client.ForkServer``; FD is its end of a UNIX
socket pair. The conversation is newline-delimited JSON of the msgspec structs below (no pickle):

    launcher -> zygote   Spawn{request_id, module, args, env, cwd, log_path}
    zygote -> launcher   Ready{pid}                          once the imports are done
                         Spawned{request_id, pid} | SpawnFailed{request_id, error}
                         Exited{pid, returncode}             for each child, as it is reaped

A child is a fresh session (``setsid``: its pid is its process group, as ``start_new_session`` gives),
logs to ``log_path`` (appended), gets exactly ``env`` and runs ``module`` as ``python -m module args``
would. It asks for SIGKILL when the zygote dies (``deploy.parent_guard``; the zygote has one thread, so
the kernel ties the signal to a thread that lives as long as the zygote).

The zygote runs no thread of its own on purpose: ``fork`` copies only the calling thread, so a zygote
whose one Python thread holds no lock at the fork hands every child a consistent interpreter (torch's
OpenMP pool is created on first use, and nothing here uses torch; numpy's OpenBLAS starts an idle pool
at import, which shuts itself down around a fork through its own ``pthread_atfork`` handlers). Library state that is read from the environment at import time is the
zygote's, not the child's: the third-party libraries, and those of Tandem's worker modules that read no
``TANDEM_*`` variable at import (``kernels.cpu_native`` does, so it loads in the worker); and
``OMP_WAIT_POLICY`` defaults to PASSIVE before torch loads, as ``deploy.serve_cmds.quiet_openmp_waits``
does for a worker started on its own.

When the launcher goes (its end of the socket closes, however it died) or the zygote gets SIGTERM, the
children get SIGKILL, as a worker of a killed launcher always did, and their shared KV caches are removed.
A child that exits has its shared KV cache removed as soon as it is reaped (``kv_transfer.shm_files``).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys

import msgspec

# Third-party modules a worker imports, loaded once here. Tandem's own modules are not (see above).
PRELOAD = (
    "numpy", "torch", "safetensors.torch", "tokenizers", "jinja2", "yaml", "zmq", "msgspec", "pydantic",
    "httpx", "prometheus_client", "llguidance", "transformers",
    # AutoConfig imports an architecture's configuration module on first use, and the first one pulls
    # transformers' model-loading machinery behind it (seconds of CPU): the architectures Tandem runs
    "transformers.activations", "transformers.models.llama.configuration_llama",
    "transformers.models.mistral.configuration_mistral", "transformers.models.qwen2.configuration_qwen2",
    "transformers.models.qwen3.configuration_qwen3", "transformers.models.qwen3_moe.configuration_qwen3_moe",
    "transformers.models.mixtral.configuration_mixtral", "transformers.models.gemma3.configuration_gemma3",
)
# Tandem's worker modules: none reads the environment when imported (kernels.cpu_native does, and is loaded
# by load_kernels in the worker, after the fork), so each worker saves their import too.
PRELOAD_TANDEM = ("deploy.serve_cmds", "pipeline.worker_base", "prefill_worker.worker", "decode_worker.worker")
# transformers loads lazily: name the parts a worker uses (config, tokenizer, rope functions).
PRELOAD_ATTRIBUTES = (
    ("transformers", "AutoConfig"), ("transformers", "AutoTokenizer"), ("transformers", "PreTrainedTokenizerFast"),
    ("transformers", "GenerationConfig"), ("transformers.modeling_rope_utils", "ROPE_INIT_FUNCTIONS"),
)


class Spawn(msgspec.Struct, tag=True):
    request_id: int
    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    log_path: str


class Ready(msgspec.Struct, tag=True):
    pid: int


class Spawned(msgspec.Struct, tag=True):
    request_id: int
    pid: int


class SpawnFailed(msgspec.Struct, tag=True):
    request_id: int
    error: str


class Exited(msgspec.Struct, tag=True):
    pid: int
    returncode: int


ToZygote = Spawn
FromZygote = Ready | Spawned | SpawnFailed | Exited
encode = msgspec.json.Encoder().encode
decode_to_zygote = msgspec.json.Decoder(ToZygote).decode
decode_from_zygote = msgspec.json.Decoder(FromZygote).decode


def preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library: the child imports it (or not) itself
            pass
    try:  # set up now, while the process's own argv and environment are as exec gave them
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    for module_name, attribute in PRELOAD_ATTRIBUTES:
        try:
            getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            pass
    for name in PRELOAD_TANDEM:
        importlib.import_module(name)


class Zygote:
    """The server loop: spawn requests in, forks, exit reports out. One thread, never blocks on a child."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: set[int] = set()
        self._buffer = b""
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_read, False)
        os.set_blocking(self._wakeup_write, False)
        self._is_stopping = False

    def run(self) -> None:
        signal.set_wakeup_fd(self._wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
        self._send(Ready(pid=os.getpid()))
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self._wakeup_read, selectors.EVENT_READ)
        while not self._is_stopping:
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is self.sock:
                    self._read_requests()
                else:
                    self._drain_wakeups()
            self._reap()
        self._kill_children()

    def _on_sigterm(self, *_) -> None:
        self._is_stopping = True

    def _read_requests(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the launcher is gone
            self._is_stopping = True
            return
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                request = decode_to_zygote(line)
            except msgspec.DecodeError as exc:
                print(f"zygote: dropped a bad request ({exc})", file=sys.stderr, flush=True)
                continue
            self._spawn(request)

    def _spawn(self, request: Spawn) -> None:
        try:
            pid = os.fork()
        except OSError as exc:
            self._send(SpawnFailed(request_id=request.request_id, error=str(exc)))
            return
        if pid == 0:
            _become_child(request, close_fds=(self.sock.fileno(), self._wakeup_read, self._wakeup_write))
        self.children.add(pid)
        self._send(Spawned(request_id=request.request_id, pid=pid))

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wakeup_read, 512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _reap(self) -> None:
        from kv_transfer.shm_files import remove_shared_kv_files_of

        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            remove_shared_kv_files_of({pid})  # a child killed by a signal could not remove its own
            self._send(Exited(pid=pid, returncode=os.waitstatus_to_exitcode(status)))

    def _send(self, message) -> None:
        try:
            self.sock.sendall(encode(message) + b"\n")
        except OSError:
            self._is_stopping = True  # the launcher is gone; nobody to tell

    def _kill_children(self) -> None:
        from kv_transfer.shm_files import remove_shared_kv_files_of

        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        remove_shared_kv_files_of(self.children)
        self.children.clear()


def _become_child(request: Spawn, close_fds: tuple[int, ...]) -> None:
    """In the forked child: become the process ``python -m module args`` would be; never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for fd in close_fds:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log_fd = os.open(request.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        from deploy.parent_guard import DIE_WITH_PARENT_ENV, die_with_parent_if_asked

        os.environ[DIE_WITH_PARENT_ENV] = str(os.getppid())  # the zygote is this process's supervisor
        die_with_parent_if_asked()
        code = _run_module(request.module, request.args)
    except BaseException:  # noqa: BLE001 - whatever happens, this fork must not return into the zygote
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        from pipeline.ipc_files import remove_bound_files

        remove_bound_files()  # what atexit does for a process that exits normally
        os._exit(code)


def _run_module(module: str, args: list[str]) -> int:
    import runpy

    try:  # ps, top and /proc/PID/cmdline show what an exec'd process would, not the zygote's command
        from setproctitle import setproctitle

        setproctitle(" ".join([sys.executable, "-m", module, *args]))
    except ImportError:
        pass
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads its OpenMP runtime
    # No parent-death signal here: a zygote outlives the launcher thread that started it (a test
    # session's clusters share one), so it watches its socket instead, which closes when the launcher
    # process goes, however it goes.
    sock = socket.socket(fileno=int(sys.argv[1]))
    preload()
    Zygote(sock).run()


if __name__ == "__main__":
    main()
