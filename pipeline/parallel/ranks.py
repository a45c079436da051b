"""The rank processes of a tensor-parallel engine: rank 0 is the calling process, ranks 1..N-1 are its children,
forked at a worker's start or from the process's preloaded fork server (``rank_start``).

Each step's inputs travel from rank 0 over a pipe per child (a pickled tuple of numpy arrays: a few
small arrays per step, with ordering, end-of-file when rank 0 dies, and no timeout while rank 0 idles
between calls); the activations travel over ``torch.distributed`` collectives (``model.Collectives``),
which time out (``timeout_s``) if a rank stops answering. A child leaves when rank 0 says stop, when
its pipe closes (rank 0 exited or was killed; the kernel also kills it then: ``_die_with``), or when a
collective fails; it ignores SIGTERM and SIGINT (rank 0 decides). ``RankGroup.close`` (also run when the group
is garbage-collected and at interpreter exit) asks every child to stop, then kills it.

The ranks meet through a ``torch.distributed.FileStore`` in a directory only this user can read (a TCPStore
would listen on every interface, open to anyone who reaches the host), and gloo's connections are on loopback:
a tensor-parallel worker opens no socket a stranger can reach. On the CPU the store is removed once every rank
is ready (connected: gloo needs it no more); NCCL connects at its first collective and keeps it until the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from pipeline.forward_batch import ForwardBatch
from pipeline.parallel.rank_start import start_rank
from pipeline.parallel.shard_spec import TensorParallelError


T = TypeVar("T")
STARTUP_TIMEOUT_S = 300.0  # starting a child (the first from the fork server: its imports) and loading its shard
STOP_GRACE_S = 5.0  # ranks asked to stop have this long to leave before they are killed


@dataclass(frozen=True)
class RankArgs:
    """What a child rank needs to build its shard (picklable: it crosses to the child)."""

    rank: int
    size: int
    store_path: str  # the group's FileStore (a private directory of rank 0's)
    model_path: str
    dtype: torch.dtype
    device: str
    kernel_backend: str
    cpu_weight_prepack: bool
    num_threads: int
    timeout_s: float
    cores: list[int] | None = None  # bound to these (its own share of the worker's cores); None: as started
    parent_pid: int = 0  # rank 0: the child gets SIGKILL when it goes (Linux), however it goes
    keep_freed_memory: bool = True  # on the CPU: pipeline/host_memory.py, as rank 0's engine does
    quantization: str | None = None  # model.quantization ("int8": W8A8 at load), as rank 0's
    environ: dict[str, str] = dataclasses.field(default_factory=dict)  # rank 0's now (the fork server has its own)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<rank>`` on GPUs (one per rank), the CPU otherwise."""
    return torch.device(f"cuda:{rank}") if str(device).startswith("cuda") else torch.device("cpu")


class RankGroup:
    """Starts ranks 1..N-1 and drives them from rank 0 (it is the ``driver`` of rank 0's ``TensorParallelLlama``)."""

    def __init__(self, size: int, model_path: str, dtype: torch.dtype, device: str, kernel_backend: str,
                 cpu_weight_prepack: bool, timeout_s: float,
                 placements: list[tuple[list[int] | None, int]] | None = None, keep_freed_memory: bool = True,
                 quantization: str | None = None):
        """``placements``: ranks 1..N-1's (cores or None, torch threads) (``cpu_placement.rank_placement``);
        default: unbound, an equal share of this process's cores in threads each. ``quantization``: the model's
        load-time quantization, applied by every rank to its shard."""
        import torch.distributed as dist

        self.size = size
        self._is_ready = False  # every child loaded its shard (wait_ready)
        self._kv_shape_sent: tuple[int, ...] | None = None
        self._keeps_store = str(device).startswith("cuda")  # NCCL: until the end (see the module's doc)
        self._store_dir = tempfile.mkdtemp(prefix="tandem-tp-store-")  # mode 0700
        self.store = dist.FileStore(os.path.join(self._store_dir, "store"), size)
        self.store.set_timeout(datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.processes: list[multiprocessing.Process] = []
        self.pipes = []
        self._grace_s = [STOP_GRACE_S]  # close(grace_s) changes it for the finalizer, which holds this list
        self._finalizer = weakref.finalize(self, _stop_ranks, self.processes, self.pipes, self._grace_s,
                                           self._store_dir)
        placements = placements or [(None, max(1, cores // size))] * (size - 1)
        for rank, (rank_cores, num_threads) in enumerate(placements, start=1):
            args = RankArgs(rank, size, self.store.path, model_path, dtype, device, kernel_backend,
                            cpu_weight_prepack, num_threads, timeout_s, rank_cores, os.getpid(), keep_freed_memory,
                            quantization, dict(os.environ))
            process, ours = start_rank(args, f"tandem-tp-rank{rank}")
            self.processes.append(process)
            self.pipes.append(ours)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def wait_ready(self) -> None:
        """Block until every child loaded its shard; ``TensorParallelError`` with its traceback if one failed."""
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect_reply(rank, pipe, "ready", "failed to start")
        self._is_ready = True
        if not self._keeps_store:  # every rank is connected (rank 0 may finish before the others read the store)
            shutil.rmtree(self._store_dir, ignore_errors=True)

    def share_kv_caches(self, kv_shape: torch.Size, dtype: torch.dtype) -> list[torch.Tensor]:
        """Ranks 1..N-1's KV caches (each ``kv_shape``), mapped into this process: each rank allocates its cache in
        shared memory itself (its pages its own), runs on it from then on, and sends the file's path, which is
        removed once mapped here (the memory lives while either side maps it). For the KV transfer of a prefill or
        decode worker (``pipeline.parallel.kv_shards``); CPU ranks only. Call it before the first forward."""
        from kv_transfer.shm import open_shared_kv_cache
        from kv_transfer.shm_files import unlink_quietly

        if self._kv_shape_sent is not None:  # the ranks already compute on caches of their own
            raise RuntimeError("share_kv_caches: the ranks' KV caches must be shared before the first forward")
        self._send(("shared_kv_cache", tuple(kv_shape)))
        self._kv_shape_sent = tuple(kv_shape)
        caches = []
        for rank, pipe in enumerate(self.pipes, start=1):
            path = self._expect_reply(rank, pipe, "shared_kv_cache", "could not share its KV cache")
            try:
                caches.append(open_shared_kv_cache(path, tuple(kv_shape), dtype))
            finally:
                unlink_quietly(path)
        return caches

    def _expect_reply(self, rank: int, pipe, kind: str, failure: str):
        """The detail of the next message from ``rank``, which must be ``kind``; watching the children meanwhile.
        ``TensorParallelError`` (the group closed) with the last line of the rank's traceback otherwise."""
        while not pipe.poll(0.5):
            self.check_alive()
        try:
            got, detail = pipe.recv()
        except EOFError:
            got, detail = "error", "exited"
        if got != kind:  # the child's whole traceback is on its stderr
            self.close()
            raise TensorParallelError(f"tensor-parallel rank {rank} {failure}: {str(detail).strip().splitlines()[-1]}")
        return detail

    def join_group(self, make_collectives: Callable[[], T]) -> T:
        """Rank 0's ``make_collectives()`` (it waits for every rank to join), watching the children meanwhile:
        one that dies before it joins raises at once instead of after the store's timeout."""
        result: dict = {}

        def run():
            try:
                result["value"] = make_collectives()
            except BaseException as exc:  # handed to the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=run, name="tandem-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive():
                self.check_alive()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def check_alive(self) -> None:
        """``TensorParallelError`` naming every child rank that exited (and the last line of the error it sent)."""
        dead = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                f"{_reported_error(pipe) or self._no_report(p.exitcode)}"
                for rank, (p, pipe) in enumerate(zip(self.processes, self.pipes), start=1) if not p.is_alive()]
        if dead:
            raise TensorParallelError("tensor-parallel " + "; ".join(dead) + ": the engine cannot continue")

    def _no_report(self, exitcode: int | None) -> str:
        """Why a rank that exited with an error before it was ready may have sent nothing: it never got to run."""
        if self._is_ready or exitcode != 1:
            return ""
        return (" before it started (its traceback is on stderr; a script that creates a tensor-parallel LLM must do "
                "so under `if __name__ == \"__main__\":`, since every rank imports that script again)")

    def name_the_dead_rank(self, within_s: float = 2.0) -> None:
        """A collective failed, most often because a rank died: the peer's socket closes as the kernel kills it, a
        moment before the process is seen to have exited. ``check_alive`` until one is, for up to ``within_s`` (a
        rank that hangs instead leaves the collective's own error to be raised)."""
        deadline = time.monotonic() + within_s
        self.check_alive()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            self.check_alive()

    def send_forward(self, batch: ForwardBatch, kv_shape: torch.Size) -> None:
        if self._kv_shape_sent != tuple(kv_shape):  # the cache is sized by rank 0's pool, after the model loads
            self._send(("kv_cache", tuple(kv_shape)))
            self._kv_shape_sent = tuple(kv_shape)
        self._send(("forward", batch.to_arrays()))

    def send_logits(self, num_rows: int) -> None:
        self._send(("logits", num_rows))

    def _send(self, message) -> None:
        self.check_alive()
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(message)
            except OSError as exc:  # BrokenPipeError: the child is gone, its pipe closed a moment before it is
                self.name_the_dead_rank()  # seen to have exited: named with its exit code once it is
                raise TensorParallelError(f"tensor-parallel rank {rank} does not answer: {exc}") from exc

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every child rank (asked first, killed if still running after ``grace_s``; 0 once the group
        failed: a rank that hung would only use up the grace). Idempotent."""
        self._grace_s[0] = grace_s
        self._finalizer()


def _reported_error(pipe) -> str:
    """``: <last line>`` of the traceback a dead child sent before it exited, or ``""``."""
    try:
        while pipe.poll():
            kind, detail = pipe.recv()
            if kind == "error":
                return ": " + detail.strip().splitlines()[-1]
    except (EOFError, OSError):
        pass
    return ""


def _stop_ranks(processes: list, pipes: list, grace_s: list[float], store_dir: str) -> None:
    shutil.rmtree(store_dir, ignore_errors=True)
    for pipe in pipes:
        try:
            pipe.send(("stop", None))
        except OSError:
            pass
    deadline = time.monotonic() + grace_s[0]  # one grace for them all: a hung rank costs it once
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():  # no SIGTERM: a rank ignores it (run_rank)
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()


def run_rank(args: RankArgs, pipe) -> None:
    """A child rank's whole life: join the group, load its shard, then run what rank 0 sends until told to stop."""
    # Rank 0 alone decides when the ranks stop: a SIGTERM or Ctrl-C to the whole process group (a launcher's
    # stop, a terminal) lets it drain its requests first, which needs every rank until the end.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _die_with(args.parent_pid)
    os.environ.clear()  # rank 0's environment now, not the fork server's (for settings read from here on)
    os.environ.update(args.environ)
    if args.cores is not None:
        from pipeline.cpu_placement import bind_to_cores

        bind_to_cores(args.cores)
    torch.set_num_threads(args.num_threads)
    try:
        model, kernels, hidden_size = _load_rank(args)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    pipe.send(("ready", None))
    device = rank_device(args.device, args.rank)
    kv_cache = None
    with torch.inference_mode():
        while True:
            try:
                kind, payload = pipe.recv()
            except (EOFError, OSError):  # rank 0 is gone
                _leave()
            if kind == "stop":
                _leave()
            if kind == "kv_cache":
                kv_cache = torch.zeros(payload, dtype=args.dtype, device=device)
            elif kind == "shared_kv_cache":
                kv_cache = _share_kv_cache(args, payload, pipe)
            elif kind == "forward":
                batch = ForwardBatch.from_arrays(payload, device)
                model(batch, kv_cache, kernels)
            elif kind == "logits":
                model.compute_logits(torch.empty(payload, hidden_size, dtype=args.dtype, device=device))


def _leave() -> None:
    """Exit at once: a rank holds nothing to clean up (its KV file is unlinked once mapped, the store and the
    collectives are sockets), and the interpreter's own shutdown (torch's, gloo's) would keep rank 0's ``close``
    waiting most of a second."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _share_kv_cache(args: RankArgs, shape: tuple[int, ...], pipe) -> torch.Tensor:
    """The rank's KV cache allocated in shared memory (``RankGroup.share_kv_caches``), its path sent to rank 0."""
    from kv_transfer.shm import allocate_shared_kv_cache, shared_kv_path

    try:
        kv_cache = allocate_shared_kv_cache(shape, args.dtype, f"tp-rank{args.rank}", remedy=(
            f"or give the worker fewer ranks (each of a prefill or decode worker's {args.size} ranks keeps its KV "
            "cache in shared memory, whatever transfer.transport says)"))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    pipe.send(("shared_kv_cache", shared_kv_path(kv_cache)))
    return kv_cache


def _die_with(parent_pid: int) -> None:
    """SIGKILL when rank 0 goes, however it goes, so no rank is left orphaned even when rank 0 is killed while
    this rank computes (the pipe's end-of-file covers the rest): ``prctl(PR_SET_PDEATHSIG)`` on the parent, rank 0
    itself or the fork server, which exits as soon as rank 0 does (its end of a pipe closes); exit now if rank 0 or
    the server went already."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    from kv_transfer.shm_files import is_running

    server_pid = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != server_pid or not is_running(parent_pid):
        os._exit(1)


def _load_rank(args: RankArgs):
    import torch.distributed as dist

    from kernels import load_kernels
    from pipeline.host_memory import keep_freed_memory
    from pipeline.parallel.model import Collectives, load_shard
    from pipeline.weights import load_hf_config

    device = rank_device(args.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(args.store_path, args.size)
    store.set_timeout(datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    collectives = Collectives(store, args.rank, args.size, device, args.timeout_s, STARTUP_TIMEOUT_S)
    hf_config = load_hf_config(args.model_path)
    model = load_shard(hf_config, args.model_path, args.dtype, device, collectives, quantization=args.quantization)
    kernels = load_kernels(args.kernel_backend, str(device))
    if device.type == "cpu" and args.keep_freed_memory:
        keep_freed_memory()
    kernels.prepare_model(model, args.cpu_weight_prepack)
    return model, kernels, hf_config.hidden_size
