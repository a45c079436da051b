"""Every ZMQ address in a Tandem deployment, derived from one ``zmq_endpoint_base`` (torch-free).

The base names a transport and a rendezvous point:

* ``ipc:///tmp/tandem`` - one host; every socket is a Unix socket file whose path starts with the base.
* ``tcp://10.0.0.5:25000`` - across hosts; the router listens on exactly that address.

Two functions give every address a process needs:

* ``router_endpoint(base)``: where the router's ROUTER socket binds and every worker's DEALER connects.
  ipc: ``{base}-router``; tcp: the base itself.
* ``worker_bind_endpoint(base, worker_id, name)``: where a worker binds one of its own listening
  sockets (``name`` says which: ``"prefill"`` for a PrefillOnly worker's request socket, ``"kv"`` for
  the transfer service, ...). ipc: a path unique to (base, worker_id, name). tcp: ``host`` (a
  worker's ``bind_host``; by default ``default_bind_host``, this machine's address on the route to the
  router) with port ``*``, so the OS picks a free one; the worker reads
  the real address back from the socket (``zmq.LAST_ENDPOINT``) and reports that string to its peers
  (``RegisterWorker.prefill_endpoint``, ``PrefillRequest.transfer_endpoint``).

A base that is not one of those two forms raises ``EndpointError`` (a ``ValueError``) saying why.
"""

from __future__ import annotations

import hashlib
import re
import socket

# sun_path is 108 bytes on Linux (104 on macOS) including the NUL; stay under both.
MAX_IPC_PATH_BYTES = 100
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_UNSAFE_CHARS_RE = re.compile(r"[^A-Za-z0-9_.-]")


class EndpointError(ValueError):
    """A ``zmq_endpoint_base`` (or a name derived from it) cannot be used."""


def validate_endpoint_base(base: str) -> str:
    """Return ``base`` unchanged when it is a usable ``ipc://`` or ``tcp://host:port`` base, else raise."""
    if not isinstance(base, str) or not base:
        raise EndpointError(f"zmq_endpoint_base: must be a non-empty string (got {base!r})")
    if base.startswith("ipc://"):
        path = base[len("ipc://"):]
        if not path or path.endswith("/"):
            raise EndpointError(
                f"zmq_endpoint_base: an ipc base needs a file path prefix such as ipc:///tmp/tandem (got {base!r})"
            )
        if "*" in path:
            raise EndpointError(f"zmq_endpoint_base: an ipc base must not contain '*' (got {base!r})")
        if len(f"{path}-router".encode()) > MAX_IPC_PATH_BYTES:
            raise EndpointError(
                f"zmq_endpoint_base: ipc path too long for a Unix socket (max {MAX_IPC_PATH_BYTES - 7} bytes, "
                f"got {len(path.encode())}: {base!r})"
            )
        return base
    if base.startswith("tcp://"):
        _split_tcp(base)
        return base
    scheme = base.split("://", 1)[0] if "://" in base else base
    raise EndpointError(
        f"zmq_endpoint_base: must start with ipc:// (one host) or tcp:// (across hosts), "
        f"e.g. ipc:///tmp/tandem or tcp://10.0.0.5:25000 (got scheme {scheme!r} in {base!r})"
    )


def router_endpoint(base: str) -> str:
    """Where the router binds its ROUTER socket and where workers connect their DEALER."""
    validate_endpoint_base(base)
    if base.startswith("ipc://"):
        return f"{base}-router"
    return base


def worker_bind_endpoint(base: str, worker_id: str, name: str, host: str | None = None) -> str:
    """Where worker ``worker_id`` binds its ``name`` socket (e.g. "prefill", "kv").

    ipc: ``{base}-{worker_id}-{name}``, with characters outside ``[A-Za-z0-9_.-]`` replaced and, when
    the path would not fit in a Unix socket address, the id shortened to a stable hash.
    tcp: ``tcp://{host or the base's host}:*``; after binding, report ``socket.getsockopt(zmq.LAST_ENDPOINT)``.
    """
    validate_endpoint_base(base)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise EndpointError(f"endpoint name must match [A-Za-z0-9_.-]+ (got {name!r})")
    if not isinstance(worker_id, str) or not worker_id:
        raise EndpointError(f"worker_id must be a non-empty string (got {worker_id!r})")
    if base.startswith("tcp://"):
        base_host, _ = _split_tcp(base)
        bind_host = base_host if host is None else host
        if not bind_host or "*" in bind_host and bind_host != "*":
            raise EndpointError(f"host must be an address, a name or '*' (got {host!r})")
        if ":" in bind_host and not bind_host.startswith("["):
            bind_host = f"[{bind_host}]"  # IPv6 literal
        return f"tcp://{bind_host}:*"
    safe_id = _UNSAFE_CHARS_RE.sub("_", worker_id)
    endpoint = f"{base}-{safe_id}-{name}"
    if len(endpoint[len("ipc://"):].encode()) > MAX_IPC_PATH_BYTES:
        digest = hashlib.sha1(worker_id.encode()).hexdigest()[:12]
        endpoint = f"{base}-{digest}-{name}"
        if len(endpoint[len("ipc://"):].encode()) > MAX_IPC_PATH_BYTES:
            raise EndpointError(f"ipc path for {name!r} too long for a Unix socket: {endpoint!r}")
    return endpoint


def default_bind_host(base: str) -> str | None:
    """The address a worker on this machine binds on for a tcp base: the local address its traffic to
    the router leaves from (the kernel's route, asked with an unsent UDP "connect"), so peers on
    other hosts can reach it; the router's own host gives the router's address. None for ipc."""
    validate_endpoint_base(base)
    if not base.startswith("tcp://"):
        return None
    host, port = _split_tcp(base)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError as exc:
        raise EndpointError(f"zmq_endpoint_base: no route from this machine to the router at {base!r} ({exc})") from None


def _split_tcp(base: str) -> tuple[str, int]:
    rest = base[len("tcp://"):]
    if rest.startswith("["):  # [IPv6]:port
        host, sep, port_text = rest[1:].partition("]:")
        host = f"[{host}]" if sep else ""
    else:
        host, sep, port_text = rest.rpartition(":")
    if not sep or not host:
        raise EndpointError(f"zmq_endpoint_base: a tcp base must be tcp://HOST:PORT (got {base!r})")
    if host == "*" or "*" in host:
        raise EndpointError(
            f"zmq_endpoint_base: the tcp host must be the router's reachable address, not '*' (got {base!r})"
        )
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise EndpointError(f"zmq_endpoint_base: tcp port must be an integer in 1..65535 (got {port_text!r} in {base!r})")
    return host, int(port_text)
