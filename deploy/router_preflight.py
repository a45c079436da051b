"""What a router needs before it starts, checked before anything is started, each failure one line naming what to
change: the HTTP port is a port and free on its host, the TLS files load, and the workers' socket address
(``zmq_endpoint_base``) can be bound. ``tandem router`` checks before uvicorn runs (its own startup errors come as
tracebacks); ``tandem up`` checks before it starts a worker."""

from __future__ import annotations

import argparse
import socket
import ssl

import zmq

from pipeline.endpoints import router_endpoint
from pipeline.security import someone_listens_on


def port_number(text: str) -> int:
    """argparse type of a TCP port: 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (got {port})")
    return port


def check_router_can_start(zmq_endpoint_base: str | None, host: str, port: int, ssl_keyfile: str | None = None,
                           ssl_certfile: str | None = None) -> None:
    """Raise ``ValueError`` naming the flag and the fix for the first thing that would stop the router
    (``zmq_endpoint_base`` None: one ``tandem up`` makes itself, nothing to check)."""
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (the certificate and its private key)")
    if ssl_certfile:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(ssl_certfile, ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-certfile {ssl_certfile} / --ssl-keyfile {ssl_keyfile}: not a PEM certificate "
                             f"and its private key ({exc})") from None
    _check_http_port(host, port)
    if zmq_endpoint_base is not None:
        _check_zmq_bind(router_endpoint(zmq_endpoint_base))


def _check_http_port(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); pick a free port"
                             ) from None


def _check_zmq_bind(endpoint: str) -> None:
    if endpoint.startswith("ipc://") and someone_listens_on(endpoint[len("ipc://"):]):
        # checked before the probe's bind, which would replace the file under the live router's feet
        raise ValueError(f"--zmq-endpoint-base: another process (a running router?) listens on {endpoint}; stop it "
                         "or pick another base")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"--zmq-endpoint-base: the router cannot listen on {endpoint} ({exc}); for ipc:// the "
                             "directory must exist and be writable, for tcp:// the port must be free") from None
        finally:
            sock.close(linger=0)
    finally:
        ctx.term()
