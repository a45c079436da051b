"""A keyed cluster spread over network namespaces, as over hosts: KV crosses a real veth link, a rogue achieves nothing.

Topology (10.213.N.0/24, N picked per run; every name carries this process's pid)::

    namespace A: bridge br0 10.213.N.1 -- router (HTTP + cluster socket) and prefill-0
       |-- veth -- namespace B: eth0 10.213.N.2 -- decode-0
       |-- veth -- namespace R: eth0 10.213.N.3 -- the rogue (no key, then another cluster's key)
       `-- veth -- this (root) namespace: 10.213.N.254 -- the test's HTTP client

Each Tandem process is its per-role CLI started with ``ip netns exec``, with no ``--bind-host``: a worker binds on
its address on the route to the router, which is what it must announce to its peers. Skipped where namespaces
cannot be made (not root, no ``ip``, no CAP_NET_ADMIN). docs/security.md says what this proves.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.security import generate_cluster_key
from tests.cluster.conftest import kv_gauges, wait_for_idle_blocks, wait_for_metric, worker_metric
from tests.security.probe import listening_endpoints, metric_total, rogue_command, rogue_replies

ROOT = Path(__file__).resolve().parents[2]
HTTP_PORT, CLUSTER_PORT = 8000, 25000  # fresh namespaces: every port is free
NUM_BLOCKS = 128
NUM_NEW_TOKENS = 6
PROMPT_LENGTHS = (57, 41, 64)  # long enough that their KV outweighs everything else crossing the link


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _free_subnet() -> str:
    """10.213.N with N no address or route of this namespace uses (concurrent runs hold one each)."""
    used = _ip("-4", "-o", "addr").stdout + _ip("-4", "route").stdout
    rng = random.Random(os.getpid() ^ time.time_ns())
    for n in rng.sample(range(1, 254), 253):
        if f"10.213.{n}." not in used:
            return f"10.213.{n}"
    pytest.skip("every 10.213.N.0/24 subnet is taken on this host")


class Network:
    """The namespaces and links above; ``close`` deletes them all (namespaces take their veth ends along)."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = {role: f"tandem-{role}-{pid}" for role in ("a", "b", "r")}
        self.host_link = f"tdn{pid}"[:15]  # the root namespace's end of its veth to A
        self.subnet = _free_subnet()
        self.address = {"a": f"{self.subnet}.1", "b": f"{self.subnet}.2", "r": f"{self.subnet}.3",
                        "host": f"{self.subnet}.254"}
        self.made: list[str] = []

    def build(self) -> None:
        a = self.ns["a"]
        for name in self.ns.values():
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", a, "link", "add", "br0", "type", "bridge")
        _ip("-n", a, "addr", "add", f"{self.address['a']}/24", "dev", "br0")
        _ip("-n", a, "link", "set", "br0", "up")
        for role in ("b", "r"):
            _ip("-n", a, "link", "add", f"to-{role}", "type", "veth", "peer", "name", "eth0", "netns", self.ns[role])
            _ip("-n", a, "link", "set", f"to-{role}", "master", "br0", "up")
            _ip("-n", self.ns[role], "addr", "add", f"{self.address[role]}/24", "dev", "eth0")
            _ip("-n", self.ns[role], "link", "set", "eth0", "up")
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", "to-host", "netns", a)
        _ip("-n", a, "link", "set", "to-host", "master", "br0", "up")
        _ip("addr", "add", f"{self.address['host']}/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        _ip("netns", "exec", a, "true")  # entering one needs more than making it (CAP_SYS_ADMIN for its /sys)

    def rx_bytes(self, role: str) -> int:
        """Bytes namespace ``role``'s eth0 has received (its only link to anyone)."""
        stats = json.loads(_ip("-n", self.ns[role], "-s", "-j", "link", "show", "eth0").stdout)
        return stats[0]["stats64"]["rx"]["bytes"]

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[role]]

    def close(self) -> None:
        _ip("link", "del", self.host_link, check=False)
        for name in self.made:
            _ip("netns", "del", name, check=False)


@pytest.fixture
def network():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    net = Network()
    try:
        try:
            net.build()
        except RuntimeError as exc:  # no CAP_NET_ADMIN, no veth or bridge support in this kernel
            pytest.skip(f"cannot build the namespaces here: {exc}")
        yield net
    finally:
        net.close()


class Processes:
    """Every process the test starts, each leading its own process group, stopped by its pid."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}  # the cluster's, which must stay up
        self.others: list[subprocess.Popen] = []  # short-lived ones (the rogues), stopped all the same

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{self.log(name)[-3000:]}"

    def stop(self) -> None:
        every = [*self.others, *self.procs.values()]
        for proc in every:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3  # a clean stop is not what this test is about
        for proc in every:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _wait_ready(url: str, procs: Processes, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            body = httpx.get(f"{url}/ready", timeout=2).json()
            if body["ready"] and sum(w["alive"] for w in body["workers"]) == 2:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"the cluster was not ready in {timeout_s:.0f}s")


def _worker_labels(url: str) -> set[str]:
    return set(re.findall(r'^tandem_worker_up\{[^}]*worker="([^"]+)"', httpx.get(f"{url}/metrics", timeout=5).text,
                          re.MULTILINE))


def test_keyed_cluster_across_namespaces(network, tiny_checkpoint, tmp_path):
    """Router and prefill in A, decode in B: greedy answers are the offline engine's, the KV crossed the veth
    link (the workers announce their own addresses, never loopback), every block comes back; a rogue in R with
    no key, then another cluster's, is answered by nobody, listed nowhere, counted by the router and by each
    worker it knocked at, and no user request fails meanwhile."""
    from pipeline import LLM, SamplingParams

    checkpoint = tiny_checkpoint("llama")
    ours = str(generate_cluster_key(tmp_path / "ours"))
    theirs = str(generate_cluster_key(tmp_path / "theirs"))
    router_host = network.address["a"]
    base = f"tcp://{router_host}:{CLUSTER_PORT}"
    url = f"http://{router_host}:{HTTP_PORT}"
    common = ["--model", checkpoint, "--zmq-endpoint-base", base, "--cluster-key-file", ours,
              "--kv-cache-page-size", "4", "--kv-cache-num-blocks", str(NUM_BLOCKS), "--max-batch-input-tokens", "64"]
    worker = ["--num-threads", "1", "--transfer-transport", "zmq"]  # KV over tcp, never shared memory
    procs = Processes(tmp_path)
    try:
        tandem = [sys.executable, "-m", "deploy.cli"]
        procs.start("router", [*network.exec_prefix("a"), *tandem, "router", "--host", router_host, "--port",
                               str(HTTP_PORT), *common, "--router-max-local-prefill-length", "0"])
        procs.start("prefill-0", [*network.exec_prefix("a"), *tandem, "prefill", "--worker-id", "prefill-0",
                                  *common, *worker])
        procs.start("decode-0", [*network.exec_prefix("b"), *tandem, "decode", "--worker-id", "decode-0",
                                 *common, *worker])
        # the offline engine's answers, computed while the cluster starts
        llm = LLM(model=checkpoint, kv_cache={"page_size": 4, "num_blocks": NUM_BLOCKS})
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENGTHS]  # the tiny vocabulary's ids
        greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        expected = [(out.token_ids, out.text) for out in llm.generate(prompts, greedy)]
        del llm
        _wait_ready(url, procs)

        # Each worker announces (and binds) its own namespace's address: peers in other namespaces reach it there.
        prefill_endpoints = listening_endpoints([procs.log("prefill-0")])
        decode_endpoints = listening_endpoints([procs.log("decode-0")])
        assert prefill_endpoints and all(e.startswith(f"tcp://{network.address['a']}:") for e in prefill_endpoints)
        assert decode_endpoints and all(e.startswith(f"tcp://{network.address['b']}:") for e in decode_endpoints)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id

        def complete(prompt: list[int]) -> tuple[list[int], str]:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_NEW_TOKENS, temperature=0,
                                            logprobs=1, extra_body={"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True})
            choice = out.choices[0]
            return [int(token.split(":")[1]) for token in choice.logprobs.tokens], choice.text

        # 1. Users' requests across the namespaces: the offline engine's tokens, KV over the veth link.
        rx_before = network.rx_bytes("b")
        assert [complete(prompt) for prompt in prompts] == expected
        assert wait_for_metric(url, "tandem_kv_transfers_total", "decode-0", len(prompts) - 1, timeout_s=5)
        kv_bytes = worker_metric(url, "tandem_kv_transfer_bytes_total", "decode-0")
        rx_delta = network.rx_bytes("b") - rx_before
        # every prompt's KV went prefill (A) -> decode (B), and the only way into B is its veth: had it gone by
        # shared memory, or not left A, B's link would have carried only the small control messages
        assert kv_bytes >= sum(PROMPT_LENGTHS) * 256, kv_bytes  # this model's KV: 512 bytes a token in fp32
        assert rx_delta >= kv_bytes, (rx_delta, kv_bytes)
        wait_for_idle_blocks(url, ["prefill-0", "decode-0"], NUM_BLOCKS)

        # 2. A rogue in R knocks at the router and at every worker socket, while users keep being served.
        refused_before = metric_total(url, "tandem_cluster_handshakes_refused_total")
        targets = prefill_endpoints + decode_endpoints
        rogues = [subprocess.Popen([*network.exec_prefix("r"), *rogue_command(base, targets, model, 4, key_file)],
                                   cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
                  for key_file in (None, theirs)]
        procs.others.extend(rogues)
        failures, answers = [], []

        def users() -> None:
            while any(r.poll() is None for r in rogues):
                try:
                    answers.append(complete(prompts[len(answers) % len(prompts)]))
                except Exception as exc:  # noqa: BLE001 - counted: the test wants none
                    failures.append(exc)

        user_thread = threading.Thread(target=users)
        user_thread.start()
        replies = [rogue_replies(r.communicate(timeout=60)[0]) for r in rogues]
        user_thread.join(60)
        assert replies == [0, 0]  # nothing anywhere answered either of them
        assert not failures and answers
        assert answers == [expected[i % len(prompts)] for i in range(len(answers))]
        ready = httpx.get(f"{url}/ready", timeout=5).json()
        assert {w["worker_id"] for w in ready["workers"]} == {"prefill-0", "decode-0"}
        assert _worker_labels(url) == {"prefill-0", "decode-0"}
        assert metric_total(url, "tandem_cluster_handshakes_refused_total") > refused_before
        for name in ("prefill-0", "decode-0"):  # the workers' own refusals, carried by their heartbeats
            assert wait_for_metric(url, "tandem_worker_handshakes_refused_total", name, 0), name
        assert metric_total(url, "tandem_worker_bad_frames_total") == 0  # not one frame of theirs got in
        assert metric_total(url, "tandem_router_bad_frames_total") == 0
        outcomes = dict(re.findall(r'^tandem_requests_total\{outcome="([^"]+)"\} ([0-9.e+-]+)$',
                                   httpx.get(f"{url}/metrics", timeout=5).text, re.MULTILINE))
        assert float(outcomes.pop("ok")) == len(prompts) + len(answers)
        assert outcomes and all(float(v) == 0 for v in outcomes.values()), outcomes  # not one request failed
        wait_for_idle_blocks(url, ["prefill-0", "decode-0"], NUM_BLOCKS)
        assert set(kv_gauges(url)) == {(m, w) for m in ("tandem_kv_blocks_used", "tandem_kv_blocks_free")
                                       for w in ("prefill-0", "decode-0")}
        procs.check_alive()
    finally:
        procs.stop()
