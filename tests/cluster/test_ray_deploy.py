"""`tandem ray up|status|down` on a real Ray head (loopback, private temp dir, stopped by pid).

One deployment of 1 prefill + 2 decode workers serves the official openai client with transformers'
exact greedy text; a SIGKILLed worker is restarted by its supervisor actor, and so is a SIGSTOPped one (its
watchdog kills it); a SIGKILLed supervisor actor takes its process down with it (no orphan) and Ray restarts it
(its restart count goes on); `tandem ray down` leaves no Tandem process and no named actor; a deployment Ray
cannot place fails and leaves nothing behind; `tandem ray restart` replaces every worker under a streaming load
with no failed request, and `tandem ray down --process decode-1` removes one (a scale-down: its streams move to
decode-0 with their KV, none fails).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, wait_for_idle_blocks
from tests.deploy.conftest import is_alive
from tests.ray_support import RayHead, free_ports, processes_mentioning, tandem_ray_deployment

pytest.importorskip("ray")

TANDEM = str(Path(sys.executable).with_name("tandem"))
PROMPTS = ["Hello there, how are you?", "The quick brown fox", "Paged attention keeps"]
WORKERS = ["prefill-0", "decode-0", "decode-1"]
CONFIG_FLAGS = ["--kv-cache-page-size", str(CLUSTER_CONFIG["kv_cache"]["page_size"]),
                "--kv-cache-num-blocks", str(CLUSTER_CONFIG["kv_cache"]["num_blocks"]),
                "--max-batch-input-tokens", str(CLUSTER_CONFIG["max_batch_input_tokens"]),
                "--router-max-local-prefill-length", "0"]  # every request goes through the prefill worker


@pytest.fixture(scope="module")
def head():
    with RayHead() as ray_head:
        yield ray_head
    assert not processes_mentioning(ray_head.temp_dir), "a Ray process of the test head survived its stop"


@pytest.fixture(scope="module")
def deployment(head, tiny_checkpoint, tmp_path_factory):
    with tandem_ray_deployment(head, TANDEM, tmp_path_factory.mktemp("ray-logs"), "--prefill", "1", "--decode", "2",
                               "--model", tiny_checkpoint("llama"), "--max-restarts", "3", "--ready-timeout", "240",
                               "--watchdog-timeout", "3",
                               *CONFIG_FLAGS, log_level="DEBUG") as info:
        yield info


def status(head, name: str | None = None) -> dict[str, dict]:
    result = head.run(TANDEM, "ray", "status", "--json", *(["--name", name] if name else []), timeout_s=60)
    assert result.returncode == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}


def wait_for(head, predicate, timeout_s: float, what: str) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    rows = {}
    while time.monotonic() < deadline:
        rows = status(head)
        if predicate(rows):
            return rows
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:g} s; status: {json.dumps(rows, indent=1)}")


def all_ready(rows: dict[str, dict]) -> bool:
    return set(rows) == {"router", *WORKERS} and all(r["state"] == "running" and r["ready"] for r in rows.values())


def assert_serves_exactly(url: str, tokenizer, reference_text) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    for prompt in PROMPTS:
        want_ids, want_text = reference_text(tokenizer(prompt)["input_ids"], 12)
        out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == want_text and out.usage.completion_tokens == len(want_ids)
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=8, temperature=0, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) > 0


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint, hf_reference):
    return hf_reference(tiny_checkpoint("llama"))[1]


def test_up_serves_transformers_exact_text(head, deployment, tokenizer, reference_text):
    up = deployment["up"]
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"Tandem is ready at {deployment['url']}/v1" in up.stdout
    assert_serves_exactly(deployment["url"], tokenizer, reference_text)


def test_status_shows_each_process_on_its_node_and_cores(head, deployment):
    rows = status(head)
    assert all_ready(rows), rows
    for name, row in rows.items():
        assert row["node_ip"] == "127.0.0.1" and row["restarts"] == 0 and is_alive(row["pid"])
        assert row["log"] == f"{deployment['log_dir']}/tandem/{name}.log"
        deployment["pids"].add(row["pid"])
    # one node, two cores: the prefill worker and the decode workers on different cores (as tandem up)
    allowed = {name: Path(f"/proc/{row['pid']}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
               for name, row in rows.items()}
    assert allowed["prefill-0"] == rows["prefill-0"]["cores"] and allowed["decode-0"] == rows["decode-0"]["cores"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert allowed["prefill-0"] != allowed["decode-0"]
    # a worker binds its own sockets on its node's address (Ray's node IP), where peers on other nodes reach it
    for name in WORKERS:
        assert "listening on tcp://127.0.0.1:" in Path(rows[name]["log"]).read_text(), name
    # `tandem --log-level DEBUG ray up`: its processes log at that level too
    for name, row in rows.items():
        assert "deploy.cli --log-level DEBUG " in Path(row["log"]).read_text(), name
    table = head.run(TANDEM, "ray", "status", timeout_s=60).stdout
    assert "decode-1" in table and f"{deployment['url']}/v1" in table
    unknown = head.run(TANDEM, "ray", "status", "--name", "nope", timeout_s=60)  # named, as `ray down` names it
    assert unknown.returncode == 1 and "no Tandem deployment 'nope' is running" in unknown.stderr, unknown


def test_up_refuses_a_second_deployment_of_the_same_name(head, deployment):
    result = head.run(TANDEM, "ray", "up", "--port", str(free_ports(1)[0]), "--log-dir", deployment["log_dir"],
                      timeout_s=120)
    assert result.returncode == 1 and "already running" in result.stderr, result.stderr


@pytest.mark.slow  # a second ray up on the shared head: 20 s of the default suite
def test_up_on_a_port_another_deployment_serves_fails_instead_of_reading_its_readiness(head, deployment):
    """Its router cannot bind the port; the other deployment's router answered /ready there, and up said ready."""
    port = deployment["url"].rsplit(":", 1)[1]
    result = head.run(TANDEM, "ray", "up", "--name", "blue", "--decode", "1", "--prefill", "0", "--port", port,
                      "--zmq-port", str(free_ports(1)[0]), "--log-dir", deployment["log_dir"], "--ready-timeout", "60",
                      *CONFIG_FLAGS, timeout_s=180)
    said = result.stdout + result.stderr
    assert result.returncode == 1 and "Tandem is ready" not in said, said
    assert "is answered by another router" in said or "keeps exiting" in said, said  # whichever comes first
    assert status(head, "blue") == {}  # what it started is stopped


def test_killed_worker_is_restarted_by_its_supervisor(head, deployment, tokenizer, reference_text):
    old_pid = status(head)["decode-0"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    rows = wait_for(head, lambda r: all_ready(r) and r["decode-0"]["pid"] not in (None, old_pid), 60,
                    "decode-0 was not restarted and ready")
    assert rows["decode-0"]["restarts"] == 1
    assert any("killed by signal SIGKILL; restarting" in e for e in rows["decode-0"]["events"]), rows["decode-0"]
    deployment["pids"].add(rows["decode-0"]["pid"])
    assert_serves_exactly(deployment["url"], tokenizer, reference_text)


def test_frozen_worker_is_killed_and_restarted_by_its_supervisor(head, deployment, tokenizer, reference_text):
    old_pid = status(head)["decode-1"]["pid"]
    os.kill(old_pid, signal.SIGSTOP)  # it neither exits nor answers: only the watchdog ends it
    rows = wait_for(head, lambda r: all_ready(r) and r["decode-1"]["pid"] not in (None, old_pid), 60,
                    "frozen decode-1 was not replaced and ready")
    events = rows["decode-1"]["events"]
    assert any("decode-1 gave no sign of life for" in e and "(it is stopped: SIGSTOP or a debugger)" in e
               and e.endswith("killing it") for e in events), events
    assert any("decode-1 was killed: it gave no sign of life" in e and "restarting now" in e for e in events), events
    assert rows["decode-1"]["restarts"] == 1 and not is_alive(old_pid)
    deployment["pids"].add(rows["decode-1"]["pid"])
    assert_serves_exactly(deployment["url"], tokenizer, reference_text)


def test_killed_supervisor_takes_its_process_down_and_ray_restarts_both(head, deployment, tokenizer,
                                                                        reference_text):
    before = status(head)["prefill-0"]
    os.kill(before["actor_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_alive(before["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(before["pid"]), "the worker outlived its supervisor actor"
    rows = wait_for(head, lambda r: all_ready(r) and r["prefill-0"]["actor_pid"] != before["actor_pid"], 90,
                    "Ray did not restart the prefill-0 supervisor and its worker")
    assert any("Ray restarted this supervisor" in e for e in rows["prefill-0"]["events"]), rows["prefill-0"]
    assert rows["prefill-0"]["cores"] == before["cores"]  # back on the same node: on the cores planned for it
    assert rows["prefill-0"]["restarts"] == before["restarts"] + 1  # the count survives its actor's restart
    deployment["pids"].add(rows["prefill-0"]["pid"])
    assert_serves_exactly(deployment["url"], tokenizer, reference_text)
    wait_for_idle_blocks(deployment["url"], WORKERS, CLUSTER_CONFIG["kv_cache"]["num_blocks"])


def test_rolling_restart_replaces_every_worker_with_no_failed_request(head, deployment, tokenizer, reference_text):
    before = status(head)
    want = {p: reference_text(tokenizer(p)["input_ids"], 160)[1] for p in PROMPTS}
    client = openai.OpenAI(base_url=f"{deployment['url']}/v1", api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    stop = threading.Event()
    outcomes: list[tuple[str, str]] = []

    def load(k: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[k % len(PROMPTS)]
            k += 1
            try:
                text = "".join(chunk.choices[0].text for chunk in client.completions.create(
                    model=name, prompt=prompt, max_tokens=160, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}) if chunk.choices)
                outcomes.append((prompt, text))
            except openai.APIError as exc:
                outcomes.append(("error", repr(exc)))

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    result = head.run(TANDEM, "ray", "restart", "--timeout", "120", timeout_s=400)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert result.returncode == 0 and "replaced 3 workers" in result.stdout, result.stdout + result.stderr
    assert result.stdout.index("prefill-0") < result.stdout.index("decode-0")  # prefill workers first
    errors = [o for o in outcomes if o[0] == "error"]
    assert not errors and outcomes, errors
    assert all(text == want[prompt] for prompt, text in outcomes)
    rows = status(head)
    assert all_ready(rows), rows
    for name in WORKERS:
        assert rows[name]["pid"] != before[name]["pid"]
        assert rows[name]["restarts"] == before[name]["restarts"], rows[name]  # a planned exit is no crash
        assert any("drained; its replacement started" in e for e in rows[name]["events"]), rows[name]
        deployment["pids"].add(rows[name]["pid"])
    wait_for_idle_blocks(deployment["url"], WORKERS, CLUSTER_CONFIG["kv_cache"]["num_blocks"])


def test_scale_down_removes_a_decode_worker_with_no_failed_request(head, deployment, tokenizer, reference_text):
    url = deployment["url"]
    for bad, error in ((["router"], "not a worker"), (["decode-0", "decode-1"], "no decode or colocated worker"),
                       (["decode-7"], "has no decode-7")):
        result = head.run(TANDEM, "ray", "down", *(a for p in bad for a in ("--process", p)), timeout_s=60)
        assert result.returncode == 1 and error in result.stderr, result.stderr
    assert all_ready(status(head))
    recomputed = metric(url, "tandem_migration_recomputed_tokens_total")
    want = {p: reference_text(tokenizer(p)["input_ids"], 160)[1] for p in PROMPTS}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    outcomes: list[tuple[str, str]] = []
    started = threading.Semaphore(0)

    def stream(prompt: str) -> None:
        try:
            text = ""
            for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=160, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    if not text:
                        started.release()
                    text += chunk.choices[0].text
            outcomes.append((prompt, text))
        except openai.APIError as exc:
            outcomes.append(("error", repr(exc)))

    threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    result = head.run(TANDEM, "ray", "down", "--name", "tandem", "--process", "decode-1", timeout_s=120)
    for t in threads:
        t.join(timeout=120)
    assert result.returncode == 0 and "removed 1 workers: decode-1" in result.stdout, result.stdout + result.stderr
    errors = [o for o in outcomes if o[0] == "error"]
    assert not errors and len(outcomes) == len(threads), errors
    assert all(text == want[prompt] for prompt, text in outcomes)
    assert metric(url, "tandem_migration_recomputed_tokens_total") == recomputed  # handed off with their KV
    rows = status(head)
    assert set(rows) == {"router", "prefill-0", "decode-0"}, rows
    assert all(r["state"] == "running" and r["ready"] for r in rows.values()), rows
    wait_for_idle_blocks(url, ["prefill-0", "decode-0"], CLUSTER_CONFIG["kv_cache"]["num_blocks"])
    text = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=160, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text == want[PROMPTS[0]]  # the deployment serves on with what is left


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_unplaceable_deployment_fails_and_leaves_nothing(head, deployment):
    result = head.run(TANDEM, "ray", "up", "--name", "nowhere", "--decode-resources", '{"decode-node": 1}',
                      "--port", str(free_ports(1)[0]), "--log-dir", deployment["log_dir"], "--ready-timeout", "3",
                      timeout_s=120)
    assert result.returncode == 1 and "could not place decode-0" in result.stderr, result.stderr
    assert status(head, "nowhere") == {}


def test_down_stops_every_process_and_actor(head, deployment):
    result = head.run(TANDEM, "ray", "down", "--name", "tandem", timeout_s=120)
    assert result.returncode == 0 and "3 processes" in result.stdout, result.stdout + result.stderr  # decode-1 left
    assert status(head) == {}
    assert not [pid for pid in deployment["pids"] if is_alive(pid)]
    assert not processes_mentioning(deployment["log_dir"])
    assert not list(Path(deployment["log_dir"]).rglob("*.cluster.key_secret"))  # no node keeps the cluster's secret
