"""Cluster socket security: CurveZMQ with one cluster key, admitted by pyzmq's ZAP authenticator.

A process configures it once at start (``configure_cluster_security``, from ``config.security``); from
then on every ``tcp://`` socket that ``pipeline.protocol.typed_socket.TypedSocket`` binds is a CURVE
server and every one it connects is a CURVE client that knows the server's key. Every process of a
cluster holds the same keypair (``tandem keygen``; the launchers make one), so the server key is the
cluster's public key and the ZAP handler admits exactly one client key: the cluster's. A peer without
the secret key cannot finish a handshake, so it never sends or receives a single message:

* no CURVE at all: the mechanisms do not match;
* a keypair of its own (or another cluster's): it cannot encrypt its HELLO to our server key (it does
  not know it), and if it ever learned the public key, ZAP still refuses its client key.

Each refused handshake on a socket this process bound is counted (``num_handshakes_refused``; the
router exports it as ``tandem_cluster_handshakes_refused_total``) and logged (rate-limited). ZAP
handling and handshake monitoring run on one small thread per ZMQ context (``_ContextGuard``), which
closes its sockets when the context terminates, so ``ctx.term()`` never waits on it.

``ipc://`` sockets are bound owner-only (mode 0700 under a 0077 umask, then chmod'ed), so only the same
Unix user can connect; ``inproc://`` needs nothing.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.base import Authenticator
from zmq.utils.monitor import parse_monitor_message

from pipeline.ipc_files import remember_bound_file

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "tandem-cluster"
KEY_NAME = "cluster"  # tandem keygen writes cluster.key (public) and cluster.key_secret (both halves)
SECRET_SUFFIX = ".key_secret"
_REFUSED_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (no CURVE, or a key that is not the cluster's)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by ZAP (a client key that is not the cluster's)",
}
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_MONITOR_STOPPED)
_NUM_LOGGED_FIRST = 10  # refusals logged one by one; after these, every _LOG_EVERY-th
_LOG_EVERY = 100
_POLL_MS = 250


class ClusterSecurityError(ValueError):
    """A cluster key is missing, unreadable or not a CURVE secret key; the message says what to do."""


@dataclass(frozen=True)
class ClusterKey:
    """The cluster's CURVE keypair (Z85 text, as pyzmq's certificates hold it)."""

    public: bytes
    secret: bytes
    path: str | None = None


# ------------------------------------------------------------------ keys
def generate_cluster_key(out_dir: str | os.PathLike) -> Path:
    """Write a fresh cluster keypair into ``out_dir`` (pyzmq's certificate format: ``cluster.key`` with the
    public key, ``cluster.key_secret`` with both, owner-only from the moment it exists: pyzmq's own
    ``create_certificates`` writes it world-readable first); returns the secret file's path, which is what
    ``--cluster-key-file`` takes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    secret_file = write_private_file(out / f"{KEY_NAME}{SECRET_SUFFIX}", _certificate_text(public, secret))
    (out / f"{KEY_NAME}.key").write_text(_certificate_text(public, None))
    return secret_file


def cluster_key_text() -> str:
    """A fresh keypair as the text of a ``cluster.key_secret`` file (what ``tandem ray up`` distributes)."""
    return _certificate_text(*zmq.curve_keypair())


def _certificate_text(public: bytes, secret: bytes | None) -> str:
    """A ZeroMQ CURVE certificate as pyzmq writes and reads it (the secret one holds both halves)."""
    text = (f"#   ZeroMQ CURVE {'**Secret** ' if secret else 'Public '}Certificate (Tandem cluster key)\n"
            "metadata\ncurve\n"
            f'    public-key = "{public.decode()}"\n')
    return text + (f'    secret-key = "{secret.decode()}"\n' if secret else "")


def write_private_file(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (0600 from the moment it exists)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


def load_cluster_key(path: str | os.PathLike) -> ClusterKey:
    """Read a cluster key file (``cluster.key_secret``); a clear error when it is missing or public only."""
    path = Path(path)
    if not path.is_file():
        raise ClusterSecurityError(f"security.cluster_key_file: no such file {str(path)!r} "
                                   "(make one with `tandem keygen --out DIR`)")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise ClusterSecurityError(f"security.cluster_key_file: cannot read {str(path)!r}: {exc}") from None
    if not secret:
        raise ClusterSecurityError(f"security.cluster_key_file: {str(path)!r} holds only a public key; pass the "
                                   f"'{KEY_NAME}{SECRET_SUFFIX}' file that `tandem keygen` wrote")
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError):
        derived = None
    if derived is None or len(public) != len(derived):
        raise ClusterSecurityError(f"security.cluster_key_file: {str(path)!r} does not hold CURVE keys (40 Z85 "
                                   "characters each); make one with `tandem keygen --out DIR`")
    if derived != public:
        raise ClusterSecurityError(f"security.cluster_key_file: in {str(path)!r} the public key is not the secret "
                                   "key's (an edited or mixed-up file); make one with `tandem keygen --out DIR`")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("cluster key %s is readable by other users; chmod 600 it", path)
    return ClusterKey(public=public, secret=secret, path=str(path))


# ------------------------------------------------------------------ the process-wide setting
_key: ClusterKey | None = None
_guards: dict[int, "_ContextGuard"] = {}
_guards_lock = threading.Lock()
_refused_lock = threading.Lock()
_num_refused = 0


def configure_cluster_security(config) -> ClusterKey | None:
    """Apply ``config.security`` to this process (call once at start, before any socket opens).

    A ``tcp://`` endpoint base with no key is refused unless ``security.insecure_cluster``: across
    hosts, a cluster socket anyone can reach would take anyone's registration, requests and KV."""
    security = config.security
    if security.cluster_key_file:
        key = load_cluster_key(security.cluster_key_file)
        set_cluster_key(key)
        logger.info("cluster sockets: CURVE with the cluster key %s", key.path)
        return key
    set_cluster_key(None)
    if config.zmq_endpoint_base.startswith("tcp://"):
        if not security.insecure_cluster:
            raise ClusterSecurityError(
                f"zmq_endpoint_base {config.zmq_endpoint_base} is tcp:// but no cluster key was given: anyone who "
                "can reach these ports could register as a worker, read prompts and write KV. Make a key with "
                "`tandem keygen --out DIR` and pass --cluster-key-file DIR/cluster.key_secret to every process "
                "(tandem up and tandem ray up make one themselves), or pass --insecure-cluster on a network you trust")
        logger.warning("cluster sockets on %s are NOT authenticated or encrypted (--insecure-cluster)",
                       config.zmq_endpoint_base)
    return None


def set_cluster_key(key: ClusterKey | None) -> None:
    """Set (or clear) the key every later ``tcp://`` bind and connect uses."""
    global _key
    _key = key


def cluster_key() -> ClusterKey | None:
    return _key


def num_handshakes_refused() -> int:
    """Handshakes refused so far on sockets this process bound (no key, a wrong key, ZAP denied)."""
    return _num_refused


# ------------------------------------------------------------------ sockets
class BindError(ValueError):
    """An address a process must listen on cannot be bound: which one, and why."""


def bind_securely(sock: zmq.Socket, endpoint: str) -> None:
    """Bind ``sock``: a CURVE server on ``tcp://`` when a key is set; owner-only on ``ipc://``. A bind that fails is
    a ``BindError`` naming the address (the CLI prints it as one line)."""
    try:
        _bind(sock, endpoint)
    except zmq.ZMQError as exc:
        raise BindError(f"cannot listen on {endpoint} ({exc}): for ipc:// the directory must exist and be writable, "
                        "for tcp:// the port must be free (--zmq-endpoint-base, --bind-host)") from None


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    if endpoint.startswith("tcp://") and _key is not None:
        sock.curve_secretkey = _key.secret
        sock.curve_publickey = _key.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering (a guard gone): refused, not let in
        guard = _guard_for(sock.context)  # its ZAP handler is bound before any peer can connect
        sock.bind(endpoint)
        guard.watch(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT))
    elif endpoint.startswith("ipc://"):
        _bind_owner_only(sock, endpoint)
    else:
        sock.bind(endpoint)


def connect_securely(sock: zmq.Socket, endpoint: str) -> None:
    """Connect ``sock``: a CURVE client of the cluster's server key on ``tcp://`` when a key is set."""
    if endpoint.startswith("tcp://") and _key is not None:
        sock.curve_serverkey = _key.public
        sock.curve_publickey = _key.public
        sock.curve_secretkey = _key.secret
    sock.connect(endpoint)


def _bind_owner_only(sock: zmq.Socket, endpoint: str) -> None:
    """The socket file is created 0700 (the umask covers the moment before chmod), so only its owner
    can connect; the umask is process-wide for that instant, which only makes other files stricter. A path
    another process listens on is refused (libzmq would replace its file and take its peers: two routers on
    one ipc:// base), a stale file from a process that is gone is bound over."""
    if someone_listens_on(endpoint[len("ipc://"):]):
        raise zmq.ZMQError(errno.EADDRINUSE, "another process listens on this socket file")
    previous = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(previous)
    path = sock.getsockopt_string(zmq.LAST_ENDPOINT)[len("ipc://"):]
    if path and not path.startswith("@"):  # "@": an abstract socket has no file
        try:
            os.chmod(path, 0o700)
        except FileNotFoundError:
            return
        remember_bound_file(path)


def someone_listens_on(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket file ``path`` (an abstract name, "@...", is
    the kernel's to refuse)."""
    if not path or path.startswith("@"):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:  # no file, not a socket, or refused: nobody listens (the file of a process that is gone)
        return False
    finally:
        probe.close()
    return True


def _count_refused(endpoint: str, why: str) -> None:
    global _num_refused
    with _refused_lock:
        _num_refused += 1
        count = _num_refused
    if count <= _NUM_LOGGED_FIRST or count % _LOG_EVERY == 0:
        logger.warning("refused a cluster handshake on %s: %s (%d refused so far)", endpoint, why, count)


def _guard_for(ctx: zmq.Context) -> "_ContextGuard":
    underlying = ctx.underlying
    with _guards_lock:
        guard = _guards.get(underlying)
        if guard is None or not guard.is_alive():
            guard = _guards[underlying] = _ContextGuard(ctx)
        return guard


class _ContextGuard(threading.Thread):
    """One per ZMQ context with a CURVE server: pyzmq's ZAP ``Authenticator`` admitting only the cluster's
    client key, and the handshake monitors of the context's secured sockets. Its sockets live on a sync
    shadow of the context (the router's is asyncio) and close when the context terminates."""

    _monitor_ids = itertools.count()

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(name="tandem-zap", daemon=True)
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self._pending: list[tuple[str, str]] = []  # (monitor address, endpoint) to connect
        self._lock = threading.Lock()
        self._started = threading.Event()
        self.start()
        self._started.wait(10)

    def watch(self, sock: zmq.Socket, endpoint: str) -> None:
        """Count and log ``sock``'s refused handshakes (called by the socket's own thread)."""
        address = f"inproc://tandem-handshakes-{os.getpid()}-{next(self._monitor_ids)}"
        sock.monitor(address, _MONITOR_EVENTS)
        with self._lock:
            self._pending.append((address, endpoint))

    def run(self) -> None:
        loop = asyncio.new_event_loop()  # pyzmq's handle_zap_message is a coroutine
        auth = Authenticator(self._ctx, log=logging.getLogger("zmq.auth"))
        monitors: dict[zmq.Socket, str] = {}
        poller = zmq.Poller()
        try:
            try:
                auth.start()  # binds inproc://zeromq.zap.01 on this context
            finally:
                self._started.set()
            auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
            poller.register(auth.zap_socket, zmq.POLLIN)
            while True:
                with self._lock:
                    pending, self._pending = self._pending, []
                for address, endpoint in pending:
                    monitor = self._ctx.socket(zmq.PAIR)
                    monitor.linger = 0
                    monitor.connect(address)
                    monitors[monitor] = endpoint
                    poller.register(monitor, zmq.POLLIN)
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is auth.zap_socket:
                        loop.run_until_complete(auth.handle_zap_message(sock.recv_multipart()))
                        continue
                    event = parse_monitor_message(sock.recv_multipart())
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # its socket closed
                        poller.unregister(sock)
                        sock.close()
                        del monitors[sock]
                    elif event["event"] in _REFUSED_EVENTS:
                        _count_refused(monitors[sock], _REFUSED_EVENTS[event["event"]])
        except zmq.ContextTerminated:
            pass
        except Exception:  # noqa: BLE001 - a guard that dies must say so; handshakes then fail closed (ZAP enforced)
            logger.exception("the cluster ZAP handler stopped")
        finally:
            for monitor in monitors:
                monitor.close()
            if auth.zap_socket is not None:
                auth.zap_socket.close(linger=0)
            loop.close()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP's question for a CURVE client (its public key, Z85): is it the cluster's?"""
        key = _key
        return key is not None and client_key == key.public
