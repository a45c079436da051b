"""What the security tests read from a running cluster and how they send the rogue (``tests.security.rogue``)
at it, shared by the loopback test and the network-namespace one."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable

import httpx


def metric_total(url: str, name: str) -> float:
    """The router's ``name`` summed over every label set (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE))


def listening_endpoints(log_texts: Iterable[str], host: str = r"[0-9.]+") -> list[str]:
    """Every ``tcp://HOST:PORT`` a worker's start-up line says it listens on (``host``: a regex)."""
    found = set()
    for text in log_texts:
        for line in text.splitlines():
            if "listening on" in line:
                found.update(re.findall(rf"tcp://{host}:\d+", line.split("listening on", 1)[1]))
    return sorted(found)


def rogue_command(router_endpoint: str, worker_endpoints: list[str], model: str, seconds: float,
                  key_file: str | None = None, python: str = sys.executable) -> list[str]:
    """The rogue's command line: register with the router, send a PrefillRequest and KV to every worker socket,
    for ``seconds``; ``key_file``: another cluster's key (None: no CURVE at all)."""
    command = [python, "-m", "tests.security.rogue", router_endpoint, *worker_endpoints, "--model-name", model,
               "--seconds", str(seconds)]
    return command + (["--key-file", key_file] if key_file else [])


def rogue_replies(stdout: str) -> int:
    """How many messages anyone answered the rogue (its last line: ``{"replies": N}``)."""
    return json.loads(stdout.strip().splitlines()[-1])["replies"]
