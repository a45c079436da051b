"""Cluster fixtures: real processes (router + workers) on loopback, torn down after each module."""

from __future__ import annotations

import contextlib
import re
import socket
import time

import httpx
import openai
import pytest

from deploy.local_launcher import LocalCluster

# max_local_prefill_length 0: every request of a P/D cluster goes through a prefill worker and a KV
# transfer, even the tests' short prompts (which the default would prefill on the decode worker).
CLUSTER_CONFIG = {"kv_cache": {"page_size": 4, "num_blocks": 512}, "max_batch_input_tokens": 64,
                  "router": {"max_local_prefill_length": 0}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# every cluster start_cluster started in this process: a failing test's report shows the warnings of those
# still running and of those it started itself
STARTED_CLUSTERS: list[LocalCluster] = []
_FIRST_OWN_CLUSTER = pytest.StashKey[int]()


def start_cluster(model_path: str, log_dir, **kwargs) -> LocalCluster:
    config = dict(CLUSTER_CONFIG)
    config.update(kwargs.pop("config", {}))
    cluster = LocalCluster(model_path=model_path, port=free_port(), config=config, log_dir=log_dir, **kwargs)
    STARTED_CLUSTERS.append(cluster)
    return cluster.start(timeout_s=240)


def cluster_warnings(clusters: list[LocalCluster], max_lines: int = 60) -> str:
    """The WARNING and ERROR lines of ``clusters``' logs (every process's), the last ``max_lines`` in time
    order: a worker declared dead, a transfer that failed, a restart."""
    lines = []
    for cluster in clusters:
        for path in sorted(cluster.log_dir.glob("*.log")):
            lines += [f"{path.stem}: {line}" for line in path.read_text(errors="replace").splitlines()
                      if " WARNING " in line or " ERROR " in line or " CRITICAL " in line]
    lines.sort(key=lambda line: line.split(": ", 1)[1])  # by time (each line begins with its timestamp)
    return "\n".join(lines[-max_lines:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        item.stash[_FIRST_OWN_CLUSTER] = len(STARTED_CLUSTERS)  # module fixtures started before this count
    outcome = yield
    report = outcome.get_result()
    if report.failed and STARTED_CLUSTERS:
        first_own = item.stash.get(_FIRST_OWN_CLUSTER, len(STARTED_CLUSTERS))
        clusters = [c for i, c in enumerate(STARTED_CLUSTERS) if i >= first_own or c.pids]
        warnings = cluster_warnings(clusters)
        if warnings:
            report.sections.append(("cluster warnings (their logs)", warnings))


@contextlib.contextmanager
def running_cluster(model_path: str, log_dir, **kwargs):
    """``start_cluster``, stopped on the way out (a module fixture's body)."""
    cluster = start_cluster(model_path, log_dir, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()


def openai_client(cluster, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture
def client(cluster) -> openai.OpenAI:
    """The official SDK pointed at the module's ``cluster`` fixture (each cluster module defines one)."""
    return openai_client(cluster)


def model_name(client: openai.OpenAI) -> str:
    """The name the cluster serves its model under (the first of /v1/models)."""
    return client.models.list().data[0].id


def kv_gauges(url: str) -> dict[tuple[str, str], float]:
    """{(metric, worker): value} for tandem_kv_blocks_used / tandem_kv_blocks_free."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    gauges = {}
    for line in text.splitlines():
        match = re.match(r'(tandem_kv_blocks_(?:used|free))\{(.*)\} ([0-9.e+-]+)$', line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            gauges[(match.group(1), labels["worker"])] = float(match.group(3))
    return gauges


def check_concurrent_greedy_streams(url: str, reference_text, num_requests: int, seed: int = 0) -> None:
    """``num_requests`` greedy streams at once (random prompts of 1-39 tokens, 1-23 new tokens), each
    checked against transformers' text."""
    import asyncio

    import openai
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 40, (num_requests,), generator=generator)]
    lengths = [int(n) for n in torch.randint(1, 24, (num_requests,), generator=generator)]

    async def stream_text(client, name, prompt, max_tokens):
        stream = await client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            name = (await client.models.list()).data[0].id
            return await asyncio.gather(*[stream_text(client, name, p, n) for p, n in zip(prompts, lengths)])

    texts = asyncio.run(run_all())
    for prompt, max_tokens, text in zip(prompts, lengths, texts):
        assert text == reference_text(prompt, max_tokens)[1]


def wait_for_idle_blocks(url: str, workers: list[str], num_blocks: int, timeout_s: float = 10.0) -> dict:
    """Wait until every worker reports 0 used and ``num_blocks`` free blocks (heartbeats lag ~0.5 s)."""
    deadline = time.monotonic() + timeout_s
    gauges = {}
    while time.monotonic() < deadline:
        gauges = kv_gauges(url)
        if all(gauges.get(("tandem_kv_blocks_used", w)) == 0 and gauges.get(("tandem_kv_blocks_free", w)) == num_blocks
               for w in workers):
            return gauges
        time.sleep(0.2)
    raise AssertionError(f"KV blocks not back to the start value: {gauges}")


@pytest.fixture(scope="session")
def reference_text(tiny_checkpoint, hf_reference):
    """``reference_text(prompt_ids, n)`` -> (token ids, text) of transformers' greedy generate()."""
    from tests.conftest import hf_greedy

    model, tokenizer = hf_reference(tiny_checkpoint("llama"))
    cache = {}

    def get(prompt_ids: list[int], max_new_tokens: int):
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            ids = hf_greedy(model, prompt_ids, max_new_tokens, ignore_eos=False)
            cache[key] = (ids, tokenizer.decode(ids, skip_special_tokens=True))
        return cache[key]

    return get


def worker_metrics(url: str, worker: str) -> dict[str, float]:
    """The router's per-worker metrics for ``worker`` (one scrape: one load report), by name."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        match = re.match(r'(\w+)\{(.*)\} ([0-9.e+-]+)$', line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(2))).get("worker") == worker:
            values.setdefault(match.group(1), float(match.group(3)))
    return values


def worker_metric(url: str, metric: str, worker: str) -> float | None:
    """The router's per-worker ``metric`` (e.g. tandem_kv_transfer_bytes_total) for ``worker``; None if absent."""
    return worker_metrics(url, worker).get(metric)


def routing_summary(url: str) -> str:
    """Each worker's routed requests, running requests and free KV blocks, from /metrics (for a failure's message:
    where the router sent a test's requests)."""
    wanted = ("tandem_routed_requests_total{", "tandem_worker_running_requests{", "tandem_kv_blocks_free{")
    return "; ".join(line for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
                     if line.startswith(wanted))


def migrations(url: str) -> float:
    """Streams the router moved to another worker after their first token (tandem_migrations_total, every cause)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
               if line.startswith("tandem_migrations_total{"))


def wait_for_metric(url: str, metric: str, worker: str, above: float, timeout_s: float = 5.0) -> bool:
    """Whether ``worker``'s ``metric`` exceeds ``above`` within ``timeout_s`` (reports lag a heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while (worker_metric(url, metric, worker) or 0.0) <= above:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def wait_for_incarnation(url: str, worker_id: str, pid: int, timeout_s: float) -> None:
    """Wait until the router's /ready lists ``worker_id`` alive as process ``pid`` (a restart re-registered)."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        try:
            seen = {w["worker_id"]: w for w in httpx.get(f"{url}/ready", timeout=2).json()["workers"]}.get(worker_id)
        except (httpx.HTTPError, ValueError, KeyError):
            seen = None
        if seen and seen["alive"] and seen.get("pid") == pid:
            return
        time.sleep(0.2)
    raise AssertionError(f"{worker_id} (pid {pid}) not alive at the router after {timeout_s:.0f}s; last seen: {seen}")


def wait_for_restart(cluster, worker_id: str, old_pid: int, timeout_s: float) -> None:
    """Wait until the launcher has started ``worker_id`` again (a pid other than ``old_pid``) and the router lists
    that incarnation alive. Reading ``cluster.pids`` right after a kill can still give the old pid: the launcher
    starts the new process a moment later, and the router never lists the old one alive again."""
    deadline = time.monotonic() + timeout_s
    while cluster.pids.get(worker_id) in (None, old_pid):
        assert time.monotonic() < deadline, f"{worker_id} (pid {old_pid}) was not restarted within {timeout_s:.0f}s"
        time.sleep(0.1)
    wait_for_incarnation(cluster.url, worker_id, cluster.pids[worker_id],
                         timeout_s=max(5.0, deadline - time.monotonic()))


def windowed_kv_bytes(config, sliding_layers: list[bool], num_prompt_tokens: int,
                      first_query: int | None = None) -> tuple[int, int]:
    """(KV bytes the transfer of a prompt moves, bytes had every layer gone whole) on a cluster of
    ``CLUSTER_CONFIG`` in fp32: full layers x every block + sliding layers x the blocks holding the keys the decode
    worker's queries from ``first_query`` on (default: the next token's position) can see, per layer and block
    its K and V pages."""
    page_size = CLUSTER_CONFIG["kv_cache"]["page_size"]
    layer_block_bytes = 2 * page_size * config.num_key_value_heads * config.head_dim * 4
    num_blocks = -(-num_prompt_tokens // page_size)
    first_query = num_prompt_tokens if first_query is None else first_query
    window = getattr(config, "sliding_window", None) or num_prompt_tokens  # no sliding layer: any window
    first_window_block = max(first_query - window + 1, 0) // page_size  # sees keys q - W + 1 .. q
    num_sliding = sum(sliding_layers)
    num_full = len(sliding_layers) - num_sliding
    windowed = (num_full * num_blocks + num_sliding * (num_blocks - first_window_block)) * layer_block_bytes
    return windowed, len(sliding_layers) * num_blocks * layer_block_bytes


def sent_kv_bytes_after(url: str, worker: str, before: float, want: float) -> float:
    """``worker``'s tandem_kv_transfer_bytes_total minus ``before`` once it reached ``want`` (within 5 s: reports
    lag a heartbeat), one heartbeat later still: what a transfer moved, nothing beyond it missed."""
    metric = "tandem_kv_transfer_bytes_total"
    deadline = time.monotonic() + 5
    while (worker_metric(url, metric, worker) or 0.0) - before < want and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.6)
    return (worker_metric(url, metric, worker) or 0.0) - before


PROMPT_TOKENS_COMPUTED = "tandem_worker_prompt_tokens_computed_total"
EARLY_PREFILLS_UNCLAIMED = "tandem_worker_early_prefills_unclaimed_total"
# What a late claim may compute again: an early prefill that no decode worker claimed within its hold (a loaded
# machine) is dropped, its published blocks stay cached, and the claim runs as a new prompt: the last partial
# block again, or, if the hold ended mid-prompt, the chunk then running and the partial block before it.
LATE_CLAIM_MAX_RECOMPUTED = CLUSTER_CONFIG["max_batch_input_tokens"] + CLUSTER_CONFIG["kv_cache"]["page_size"]


def check_served_1p1d_matches_offline(cluster, offline, prompts: list[list[int]], num_new_tokens: int,
                                      atol: float) -> None:
    """Each prompt's greedy completion served by a 1P1D ``cluster`` is ``offline``'s (an ``LLM`` on the same checkpoint:
    the same tokens, logprobs within ``atol``), every prompt was prefilled on prefill-0 and none on decode-0, and
    afterwards every KV block is back."""
    from pipeline import SamplingParams

    want = offline.generate(prompts, SamplingParams(max_tokens=num_new_tokens, temperature=0.0, logprobs=0))
    client = openai_client(cluster)
    name = model_name(client)
    for prompt, expected in zip(prompts, want):
        out = client.completions.create(model=name, prompt=prompt, max_tokens=num_new_tokens, temperature=0,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        choice = out.choices[0]
        assert [int(token.split(":")[1]) for token in choice.logprobs.tokens] == expected.token_ids
        want_logprobs = [entry[token] for token, entry in zip(expected.token_ids, expected.logprobs)]
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, want_logprobs)) < atol
    deadline = time.monotonic() + 5  # reports lag a heartbeat
    while (worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "prefill-0") or 0) < sum(map(len, prompts)):
        assert time.monotonic() < deadline, "the prefill worker did not prefill every prompt"
        time.sleep(0.1)
    assert not worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "decode-0")
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])


def prompt_tokens_computed(url: str, worker: str) -> tuple[float, float]:
    """(prompt tokens computed, early prefills unclaimed) of ``worker``, from one load report."""
    values = worker_metrics(url, worker)
    return values.get(PROMPT_TOKENS_COMPUTED, 0.0), values.get(EARLY_PREFILLS_UNCLAIMED, 0.0)


def check_prompt_tokens_computed(url: str, worker: str, want: int, before: tuple[float, float] = (0.0, 0.0),
                                 timeout_s: float = 5.0) -> None:
    """``worker`` ran exactly ``want`` prompt tokens through the model since ``before`` (``prompt_tokens_computed``),
    plus what late claims of its early prefills computed again (``LATE_CLAIM_MAX_RECOMPUTED`` each, at most).
    Waits ``timeout_s`` for the count (reports lag a heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        computed, unclaimed = prompt_tokens_computed(url, worker)
        computed, late = computed - before[0], unclaimed - before[1]
        if want <= computed <= want + late * LATE_CLAIM_MAX_RECOMPUTED:
            return
        assert computed <= want and time.monotonic() < deadline, (
            f"{worker} computed {computed:g} prompt tokens, {want} expected "
            f"({late:g} early prefills unclaimed in their hold)")
        time.sleep(0.1)


def check_greedy_against_transformers(cluster, model, tokenizer, prompt_ids: list[list[int]], num_new_tokens: int,
                                      is_remote_prefill: bool) -> None:
    """Greedy completions of ``prompt_ids`` through ``cluster`` are transformers' own, token for token, with
    its logprobs (1e-4); with ``is_remote_prefill`` (a 1P1D cluster) every prompt ran on prefill-0 and none on
    decode-0; afterwards every KV block is back. A new architecture's cluster test in one call."""
    from tests.conftest import hf_greedy, hf_logprobs

    client = openai_client(cluster)
    name = model_name(client)
    for ids in prompt_ids:
        want = hf_greedy(model, ids, num_new_tokens, ignore_eos=False)
        out = client.completions.create(model=name, prompt=ids, max_tokens=num_new_tokens, temperature=0,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        choice = out.choices[0]
        assert [int(token.split(":")[1]) for token in choice.logprobs.tokens] == want  # "token_id:N"
        assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
        reference = hf_logprobs(model, ids + want)[len(ids) - 1 : -1]  # [len(want), vocab]
        assert max(abs(logprob - reference[step, token].item())
                   for step, (token, logprob) in enumerate(zip(want, choice.logprobs.token_logprobs))) < 1e-4
    if is_remote_prefill:  # reports lag a heartbeat
        deadline = time.monotonic() + 5
        while (worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "prefill-0") or 0) < sum(map(len, prompt_ids)):
            assert time.monotonic() < deadline, "the prefill worker did not prefill every prompt"
            time.sleep(0.1)
        assert not worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "decode-0")
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
