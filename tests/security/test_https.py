"""The router over HTTPS (a self-signed certificate made here) with several API keys, through the official SDK."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.cluster.conftest import model_name, running_cluster


def _self_signed(directory) -> tuple[str, str]:
    """(key file, certificate file) for 127.0.0.1 and localhost; the certificate is its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = directory / "key.pem", directory / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


@pytest.fixture(scope="module")
def https_cluster(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    key_file, cert_file = _self_signed(directory)
    keys_file = directory / "api-keys"
    keys_file.write_text("# one key per line\nold-key\n\nnew-key\n")
    with running_cluster(tiny_checkpoint("llama"), directory / "logs", num_prefill=0, num_decode=0, num_colocated=1,
                         api_key=f"@{keys_file}", ssl_keyfile=key_file, ssl_certfile=cert_file) as cluster:
        yield cluster, cert_file


def _client(cluster, cert_file: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=api_key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=cert_file))


def test_https_with_the_certificate_as_ca_and_any_listed_key(https_cluster):
    cluster, cert_file = https_cluster
    assert cluster.url.startswith("https://")
    # Each client closed when done: an idle TLS connection left open holds the router's shutdown until
    # asyncio's SSL shutdown timeout (30 s) at the fixture's stop.
    for key in ("old-key", "new-key"):  # both lines of the key file (a rotation's overlap)
        with _client(cluster, cert_file, key) as client:
            out = client.completions.create(model=model_name(client), prompt="Hello", max_tokens=3)
            assert out.usage.completion_tokens == 3
    with _client(cluster, cert_file, "not-a-key") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the certificate
        openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="new-key", max_retries=0, timeout=10).models.list()
    with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{cluster.port}/health", timeout=5).raise_for_status()


def test_the_launcher_hands_the_router_its_api_key_out_of_argv(https_cluster):
    """A process's command line is readable by every local user (/proc/PID/cmdline): the key (or key file) goes
    in the router's environment, which only its owner reads."""
    cluster, _ = https_cluster
    pid = cluster.processes["router"].pid
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"--api-key" not in argv and not any(b"api-keys" in arg for arg in argv), argv
    assert b"TANDEM_API_KEY=@" in Path(f"/proc/{pid}/environ").read_bytes()
