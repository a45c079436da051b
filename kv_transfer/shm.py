"""KV caches in POSIX shared memory (/dev/shm), so a sender on the same host writes straight into them.

A decode worker that enables the shm transport allocates its cache with ``allocate_shared_kv_cache``;
the receiver hands the file's path to senders at handshake, and each sender maps it once.

Memory is committed when the cache is allocated (``posix_fallocate``): a /dev/shm too small for it is
a clear error at start-up, not a SIGBUS in the middle of serving. Each mapping is also prefaulted in the
background (``MADV_POPULATE_WRITE``), so transfers do not pay a page fault per 4 KiB.

Lifetime: the file is removed by ``free_shared_kv_cache``, by ``KVReceiver.close()`` for the cache it
serves, or at interpreter exit. Memory stays mapped (and valid) in every process that still holds a
mapping, and is returned to the OS when the last mapping goes. A crashed process cannot clean up: its
files are named ``/dev/shm/tandem-kv.<pid>.<name>`` and ``remove_stale_shared_kv_caches()`` (run it at
worker start, or by hand: ``rm /dev/shm/tandem-kv.*``) deletes those whose pid no longer runs.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import math
import os
import re
import threading

import torch

from kv_transfer.shm_files import SHM_DIR, remove_stale_shared_kv_files, shared_kv_file_path, unlink_quietly

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
_lock = threading.Lock()
_owned: dict[int, str] = {}  # storage data_ptr -> file path, for caches this process allocated


_ZMQ_REMEDY = "or set transfer.transport to zmq"


def allocate_shared_kv_cache(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, name: str,
                             remedy: str = _ZMQ_REMEDY) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` backed by a new file ``/dev/shm/tandem-kv.<pid>.<name>``.

    ``shape`` is the KV cache shape ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``.
    Raises ``FileExistsError`` if this process already allocated a cache under ``name``, and ``OSError`` (ENOSPC)
    naming what to change when /dev/shm is too small for it (``remedy``: the last way out it lists).
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"name: only letters, digits, '_', '.', '-' (1-100 chars) are allowed (got {name!r})")
    path = shared_kv_file_path(os.getpid(), name)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # never clobber another cache
    try:
        _reserve(fd, nbytes, path, remedy)
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    # In the background, as a sender's mapping is: a worker registers without waiting for every page of a
    # cache of many GiB (the memory is already committed by the fallocate above; pages touched first fault).
    threading.Thread(target=prefault, args=(tensor,), name="kv-prefault", daemon=True).start()
    with _lock:
        _owned[tensor.untyped_storage().data_ptr()] = path
    return tensor


def shared_kv_path(kv_cache: torch.Tensor) -> str | None:
    """The /dev/shm file behind ``kv_cache`` if this process allocated it here, else None (also for a tensor-parallel
    worker's ``ShardedKVCache``, which is not one file)."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.device.type != "cpu":
        return None
    with _lock:
        return _owned.get(kv_cache.untyped_storage().data_ptr())


def free_shared_kv_cache(kv_cache: torch.Tensor) -> None:
    """Remove the file behind ``kv_cache`` (idempotent). The tensor stays usable until it is dropped."""
    with _lock:
        path = _owned.pop(kv_cache.untyped_storage().data_ptr(), None)
    if path is not None:
        unlink_quietly(path)


def open_shared_kv_cache(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map another process's shared KV cache (a sender does this once per receiver)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    size = os.stat(path).st_size  # FileNotFoundError if gone; torch.from_file would create it instead
    if size != nbytes:
        raise ValueError(f"shared KV cache {path}: file has {size} bytes, the layout needs {nbytes}")
    tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
    # In the background: for a cache of many GiB this takes a while, and the caller (a sender's I/O
    # thread, mid-handshake) has other transfers to serve; pages it touches first just fault as usual.
    threading.Thread(target=prefault, args=(tensor,), name="kv-prefault", daemon=True).start()
    return tensor


def _reserve(fd: int, nbytes: int, path: str, remedy: str) -> None:
    """Commit ``nbytes`` of /dev/shm to the file now, or fail with a message that says what to change."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        stat = os.statvfs(os.path.dirname(path))
        raise OSError(errno.ENOSPC, (
            f"not enough shared memory for the KV cache: it needs {nbytes / 2**30:.2f} GiB, {SHM_DIR} has "
            f"{stat.f_bavail * stat.f_frsize / 2**30:.2f} GiB free; enlarge {SHM_DIR} (docker: --shm-size), "
            f"lower kv_cache.cpu_kv_cache_gib / num_blocks, {remedy}")) from None


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def prefault(tensor: torch.Tensor) -> bool:
    """Map every page of ``tensor``'s memory into this process now, writable, without touching the data
    (``MADV_POPULATE_WRITE``). Best effort: False where the kernel does not support it."""
    if _libc is None or not hasattr(_libc, "madvise"):
        return False
    storage = tensor.untyped_storage()
    page = os.sysconf("SC_PAGE_SIZE")
    start = storage.data_ptr() & ~(page - 1)
    length = storage.data_ptr() + storage.nbytes() - start
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


def host_id() -> str:
    """Equal in two processes exactly when they see the same /dev/shm (same host, same mount)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "?"
    try:
        st = os.stat(SHM_DIR)
        mount = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"no-shm-{os.getpid()}-{id(host_id)}"  # never equal to anyone: no shm transport
    return f"{os.uname().nodename}/{boot_id}/{mount}"


def remove_stale_shared_kv_caches() -> list[str]:
    """Delete ``/dev/shm/tandem-kv.<pid>.*`` files of processes that no longer run; returns the paths."""
    return remove_stale_shared_kv_files()


@atexit.register
def _remove_owned_files() -> None:
    with _lock:
        paths = list(_owned.values())
        _owned.clear()
    for path in paths:
        unlink_quietly(path)
