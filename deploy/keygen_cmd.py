"""``tandem keygen --out DIR``: a cluster key, and the security flags every process and launcher takes
(the cluster key; the HTTP API's keys and TLS).

The key is a CurveZMQ keypair in pyzmq's certificate format (``DIR/cluster.key`` public,
``DIR/cluster.key_secret`` both halves, owner-only); every process of one cluster gets the secret file
with ``--cluster-key-file`` (docs/security.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

KEY_FILE_FLAG = "--cluster-key-file"
API_KEY_ENV = "TANDEM_API_KEY"  # the router's --api-key default (how the launchers hand it the key: not in argv)


def register(sub) -> None:
    parser = sub.add_parser("keygen", help="write a cluster key (CurveZMQ) for --cluster-key-file",
                            description="Write a new cluster keypair: DIR/cluster.key (public) and "
                                        "DIR/cluster.key_secret (secret, mode 0600), which every process of the "
                                        "cluster takes as --cluster-key-file DIR/cluster.key_secret.")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write the key files into")
    parser.add_argument("--force", action="store_true", help="replace a key already in DIR")
    parser.set_defaults(handler=run)


def add_security_flags(parser: argparse.ArgumentParser, *, launcher: bool = False) -> None:
    """``--cluster-key-file`` and ``--insecure-cluster`` (config ``security.*``). A launcher makes a key
    itself when none is given, so it says so."""
    made = " (default: a fresh key made for this cluster)" if launcher else ""
    group = parser.add_argument_group("cluster security (docs/security.md)")
    group.add_argument(KEY_FILE_FLAG, dest="cfg:security.cluster_key_file", default=argparse.SUPPRESS,
                       metavar="PATH", help="the cluster key, cluster.key_secret from `tandem keygen`; "
                       f"tcp:// cluster sockets admit only peers holding it, encrypted{made}")
    if not launcher:
        group.add_argument("--insecure-cluster", dest="cfg:security.insecure_cluster", action="store_const",
                           const="true", default=argparse.SUPPRESS,
                           help="start with a tcp:// endpoint base and no cluster key: anyone who reaches the "
                                "ports can join the cluster, read prompts and write KV")


def add_http_security_flags(parser: argparse.ArgumentParser, *, api_key_default: str | None = None,
                            api_key_default_text: str = "no key") -> None:
    """The HTTP API's ``--api-key`` (several allowed) and TLS (``--ssl-keyfile``, ``--ssl-certfile``: vLLM's names)."""
    parser.add_argument("--api-key", default=api_key_default, metavar="KEY[,KEY...]|@FILE",
                        help="require 'Authorization: Bearer KEY' on /v1; several keys comma-separated, or @FILE "
                             "with one key per line (# comments), any of them accepted "
                             f"(default: {api_key_default_text})")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS: the PEM private key")
    parser.add_argument("--ssl-certfile", default=None, metavar="PATH",
                        help="serve HTTPS: the PEM certificate (chain) of --ssl-keyfile")


def parse_api_keys(text: str | None) -> list[str] | None:
    """``--api-key``: ``KEY``, ``KEY1,KEY2`` or ``@FILE`` (one key per line; blank lines and ``#`` comments
    skipped) -> the keys; None when no key is given. Read at start: a rotation restarts the router."""
    if not text:
        return None
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise ValueError(f"--api-key: no such file {str(path)!r}")
        lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
        keys = [line for line in lines if line]
    else:
        keys = [key.strip() for key in text.split(",") if key.strip()]
    if not keys:
        raise ValueError(f"--api-key: no key in {text!r}")
    return keys


def run(args: argparse.Namespace) -> int:
    from pipeline.security import KEY_NAME, SECRET_SUFFIX, generate_cluster_key

    out = Path(args.out)
    secret = out / f"{KEY_NAME}{SECRET_SUFFIX}"
    if secret.exists() and not args.force:
        raise ValueError(f"{secret} exists; pass --force to replace it (every process then needs the new key)")
    path = generate_cluster_key(out)
    print(f"cluster key written: {path} (secret, mode 0600) and {out / (KEY_NAME + '.key')} (public)")
    print(f"give every process of the cluster {KEY_FILE_FLAG} {path}")
    return 0
