"""Cluster keys, the API key syntax and the socket layer's security, in one process (no cluster)."""

from __future__ import annotations

import os
import stat
import time

import msgspec
import pytest
import zmq
import zmq.auth

from deploy.cli import main
from deploy.keygen_cmd import parse_api_keys
from pipeline import security
from pipeline.protocol.cluster import Heartbeat, WorkerLoad, decode_worker_to_router
from pipeline.protocol.typed_socket import TypedSocket


@pytest.fixture
def cluster_key(tmp_path):
    key = security.load_cluster_key(security.generate_cluster_key(tmp_path / "key"))
    security.set_cluster_key(key)
    yield key
    security.set_cluster_key(None)


def test_keygen_writes_an_owner_only_key(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path)]) == 0
    secret = tmp_path / "cluster.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert security.load_cluster_key(secret).secret
    assert main(["keygen", "--out", str(tmp_path)]) == 2  # never overwrites a key by accident
    assert "--force" in capsys.readouterr().err
    with pytest.raises(security.ClusterSecurityError, match="only a public key"):
        security.load_cluster_key(tmp_path / "cluster.key")
    with pytest.raises(security.ClusterSecurityError, match="tandem keygen"):
        security.load_cluster_key(tmp_path / "missing")


def test_the_secret_key_is_never_readable_by_others(tmp_path, monkeypatch):
    """Created owner-only, not chmod'ed after it was written (pyzmq's create_certificates opens it 0666: a local user
    could open it in that window and keep reading). Without chmod, a write-then-chmod key stays world-readable."""
    monkeypatch.setattr(os, "chmod", lambda *args, **kwargs: None)
    previous = os.umask(0o022)
    try:
        secret = security.generate_cluster_key(tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert security.load_cluster_key(secret).public == zmq.auth.load_certificate(str(tmp_path / "cluster.key"))[0]


@pytest.mark.parametrize("edit, message", [
    (lambda public, secret: (public, "tooShort"), "does not hold CURVE keys"),
    (lambda public, secret: (zmq.curve_keypair()[0].decode(), secret), "the public key is not the secret key's"),
])
def test_a_malformed_key_file_is_refused_by_name(tmp_path, edit, message):
    """It used to start, then fail to bind with an error that blamed the port (a short key), or run with a public
    key no peer could match (a mixed-up file)."""
    public, secret = (key.decode() for key in zmq.curve_keypair())
    public, secret = edit(public, secret)
    path = tmp_path / "cluster.key_secret"
    path.write_text(f'metadata\ncurve\n    public-key = "{public}"\n    secret-key = "{secret}"\n')
    path.chmod(0o600)
    with pytest.raises(security.ClusterSecurityError, match=f"{path}.*{message}"):
        security.load_cluster_key(path)


def test_api_keys_comma_separated_or_from_a_file(tmp_path):
    assert parse_api_keys(None) is None
    assert parse_api_keys("a, b,") == ["a", "b"]
    (tmp_path / "keys").write_text("# comment\nfirst\n\n second  # trailing\n")
    assert parse_api_keys(f"@{tmp_path / 'keys'}") == ["first", "second"]
    with pytest.raises(ValueError, match="no such file"):
        parse_api_keys(f"@{tmp_path / 'none'}")


def _heartbeat() -> Heartbeat:
    return Heartbeat(worker_id="w", load=WorkerLoad())


def test_curve_admits_the_cluster_key_only_and_counts_the_rest(cluster_key, tmp_path):
    ctx = zmq.Context()
    server = TypedSocket(ctx, zmq.ROUTER, decode_worker_to_router, "test server")
    endpoint = server.bind("tcp://127.0.0.1:*")
    assert server.socket.curve_server
    member = TypedSocket(ctx, zmq.DEALER, decode_worker_to_router, "member")
    member.connect(endpoint)
    strangers = [ctx.socket(zmq.DEALER) for _ in range(2)]
    other_public, other_secret = zmq.curve_keypair()
    strangers[1].curve_publickey, strangers[1].curve_secretkey = other_public, other_secret
    strangers[1].curve_serverkey = other_public  # another cluster's key: it cannot know ours
    refused_before = security.num_handshakes_refused()
    for stranger in strangers:
        stranger.linger = 0
        stranger.connect(endpoint)
        stranger.send(msgspec.msgpack.encode(_heartbeat()))
    member.send(_heartbeat())
    received = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if server.socket.poll(100):
            received.extend(server.receive_ready())
    assert len(received) == 1 and server.num_bad_frames == 0  # the member's, and nothing else
    assert security.num_handshakes_refused() >= refused_before + 2
    for sock in strangers:
        sock.close()
    member.close()
    server.close()
    ctx.term()  # the ZAP thread lets go of the context at once


def test_a_stranger_is_refused_even_once_the_zap_handler_is_gone(cluster_key, monkeypatch, caplog):
    """Fail closed: with no ZAP handler answering (the guard thread died), libzmq would let any CURVE client in,
    one that knows only the cluster's public key (cluster.key, world-readable) included, unless ZAP is enforced."""
    def broken(self, message):
        raise RuntimeError("the ZAP handler broke")

    monkeypatch.setattr(security.Authenticator, "handle_zap_message", broken)
    ctx = zmq.Context()
    server = TypedSocket(ctx, zmq.ROUTER, decode_worker_to_router, "test server")
    endpoint = server.bind("tcp://127.0.0.1:*")
    guard = security._guards[ctx.underlying]
    elsewhere = zmq.Context()  # the strangers' own process, as it were
    strangers = []
    for _ in range(2):  # the first one's handshake kills the guard; the second finds no ZAP handler at all
        stranger = elsewhere.socket(zmq.DEALER)
        stranger.linger = 0
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.curve_serverkey = cluster_key.public
        stranger.connect(endpoint)
        stranger.send(msgspec.msgpack.encode(_heartbeat()))
        strangers.append(stranger)
        guard.join(5)
        assert not guard.is_alive()
    assert not server.socket.poll(2000)  # nothing got in
    for sock in strangers:
        sock.close()
    elsewhere.term()
    server.close()
    ctx.term()


def test_ipc_sockets_are_owner_only(tmp_path):
    ctx = zmq.Context()
    sock = TypedSocket(ctx, zmq.ROUTER, decode_worker_to_router, "ipc")
    sock.bind(f"ipc://{tmp_path}/sock")
    mode = stat.S_IMODE(os.stat(tmp_path / "sock").st_mode)
    assert mode & 0o077 == 0, oct(mode)
    sock.close()
    ctx.term()


def test_a_tcp_base_without_a_key_is_refused_unless_insecure():
    from pipeline.config import PipelineConfig

    with pytest.raises(security.ClusterSecurityError, match="--insecure-cluster"):
        security.configure_cluster_security(PipelineConfig(zmq_endpoint_base="tcp://127.0.0.1:25000"))
    assert security.configure_cluster_security(
        PipelineConfig(zmq_endpoint_base="tcp://127.0.0.1:25000", security={"insecure_cluster": True})) is None
    assert security.configure_cluster_security(PipelineConfig(zmq_endpoint_base="ipc:///tmp/x")) is None


def test_refusals_at_a_worker_reach_the_routers_metrics(cluster_key):
    """A worker's own sockets (prefill requests, KV) refuse strangers in the worker's process, not the router's:
    its heartbeat carries the count, and the router lists it per worker; a heartbeat from a worker that predates
    the field decodes as 0."""
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.protocol.cluster import RegisterWorker, WorkerRole, encode
    from router.metrics import RouterMetrics
    from router.registry import WorkerRegistry

    registry = WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0)
    metrics = RouterMetrics(registry)
    for worker_id, role in (("prefill-0", WorkerRole.PREFILL_ONLY), ("decode-0", WorkerRole.DECODE_ONLY)):
        registry.register(RegisterWorker(worker_id=worker_id, role=role, model_name="m", max_length=128, page_size=16,
                                         num_total_blocks=32, prefill_endpoint=None, pid=1))
    wire = encode(Heartbeat(worker_id="prefill-0", load=WorkerLoad(num_total_blocks=32, num_handshakes_refused=7)))
    registry.heartbeat(decode_worker_to_router(wire))
    old = encode(Heartbeat(worker_id="decode-0", load=WorkerLoad(num_total_blocks=32)))  # fields omitted as defaults
    registry.heartbeat(decode_worker_to_router(old))
    refused = {sample.labels["worker"]: sample.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for sample in family.samples if sample.name == "tandem_worker_handshakes_refused_total"}
    assert refused == {"prefill-0": 7.0, "decode-0": 0.0}
