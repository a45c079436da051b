"""KV-aware routing on real clusters: a conversation's later turns go where its blocks are (counted on
/metrics), every turn is transformers' greedy text, a turn under P/D moves only the blocks its decode
worker lacks (and its prefill worker computes only what it lacks), a killed worker's blocks leave the index, and free blocks return to the start."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, PROMPT_TOKENS_COMPUTED, check_prompt_tokens_computed,
                                    openai_client, prompt_tokens_computed, running_cluster, wait_for_idle_blocks,
                                    wait_for_restart, worker_metric)

NUM_BLOCKS = CLUSTER_CONFIG["kv_cache"]["num_blocks"]
PAGE = CLUSTER_CONFIG["kv_cache"]["page_size"]
WARMUP = "tandem_worker_warmup_tokens_computed_total"


def routed(url: str) -> dict[tuple[str, str], float]:
    """{(worker, side): requests routed} from /metrics."""
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        match = re.match(r'tandem_routed_requests_total\{(.*)\} ([0-9.e+-]+)$', line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            counts[(labels["worker"], labels["side"])] = float(match.group(2))
    return counts


def routed_to(url: str, before: dict, side: str = "decode") -> str:
    after = routed(url)
    [worker] = [w for (w, s), n in after.items() if s == side and n > before.get((w, s), 0)]
    return worker


def wait_indexed(url: str, worker: str, timeout_s: float = 5.0) -> None:
    """KV events travel beside the tokens; give the last ones a moment to land in the index."""
    deadline = time.monotonic() + timeout_s
    while (worker_metric(url, "tandem_kv_index_blocks", worker) or 0) == 0:
        assert time.monotonic() < deadline, f"the router's index holds nothing for {worker}"
        time.sleep(0.05)


def wait_for_warmup(url: str, worker: str, before: float, num_prompt_tokens: int, token_ids: list[int]) -> int:
    """A turn under P/D ended: wait until its prefill worker (whose warm-up count was ``before`` the turn)
    has warmed its cache with prompt + answer (router.warm_prefill_cache); returns the leading tokens it
    then holds (full blocks)."""
    warmed = len(token_ids) // PAGE * PAGE
    expected = warmed - num_prompt_tokens  # its own prefill holds the prompt's KV, its last partial block too
    deadline = time.monotonic() + 10
    while (worker_metric(url, WARMUP, worker) or 0.0) < before + expected:  # reported with the next heartbeat
        assert time.monotonic() < deadline, f"{worker} never warmed up the {expected} tokens of the answer"
        time.sleep(0.05)
    return warmed


def conversation(tokenizer, turns: int = 3):
    """Turn prompts as token ids: each turn repeats the last prompt and its answer, then adds a message."""
    messages = [" The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
                " Paged attention keeps the cache in blocks; prefixes are shared.",
                " Once upon a time, in a small town by the sea, there lived a baker."]
    return [tokenizer(m)["input_ids"] for m in messages[:turns]]


@pytest.fixture(scope="module")
def colocated(tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("kv-colocated"), num_prefill=0,
                         num_decode=0, num_colocated=2, max_restarts=2) as c:
        yield c


def test_later_turns_go_where_the_conversation_is(colocated, hf_reference, tiny_checkpoint, reference_text):
    url = colocated.url
    client = openai_client(colocated)
    name = client.models.list().data[0].id
    _, tokenizer = hf_reference(tiny_checkpoint("llama"))
    # a long stream on colocated-0 makes the first turn go to colocated-1 (both idle, the id would decide)
    hog = client.completions.create(model=name, prompt="hold the first worker busy " * 4, max_tokens=400,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(hog))
    prompt: list[int] = []
    for turn, message in enumerate(conversation(tokenizer)):
        prompt = prompt + message
        before = routed(url)
        out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        worker = routed_to(url, before)
        ids, text = reference_text(prompt, 8)
        assert out.choices[0].text == text  # every turn is transformers' greedy continuation
        if turn == 0:
            hog.close()  # both workers idle again: only the cache tells them apart now
            first = worker
            assert first == "colocated-1"
        else:
            assert worker == first, f"turn {turn} left the worker holding the conversation"
            # it held the whole last turn but its last answer token (whose KV no step wrote), the last
            # partly filled block included (a partial tail)
            assert out.usage.prompt_tokens_details.cached_tokens == len(prompt) - len(message) - 1
        wait_indexed(url, first)
        prompt = prompt + ids
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    hits = float(re.search(r'tandem_routed_cached_prompt_tokens_total\{side="decode"\} ([0-9.e+]+)', metrics)[1])
    assert hits > 0
    wait_for_idle_blocks(url, colocated.worker_names, NUM_BLOCKS)


def test_a_killed_workers_blocks_leave_the_index(colocated, tiny_checkpoint, hf_reference):
    url = colocated.url
    client = openai_client(colocated)
    name = client.models.list().data[0].id
    _, tokenizer = hf_reference(tiny_checkpoint("llama"))
    prompt = tokenizer(" A prompt to remember, long enough to fill several blocks of the cache.")["input_ids"]
    before = routed(url)
    client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    worker = routed_to(url, before)
    wait_indexed(url, worker)
    old_pid = colocated.pids[worker]
    colocated.kill(worker, signal.SIGKILL)
    wait_for_restart(colocated, worker, old_pid, timeout_s=30)
    assert worker_metric(url, "tandem_kv_index_blocks", worker) == 0  # a new process: nothing cached
    before = routed(url)
    again = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    other = routed_to(url, before)
    if other == worker:  # only if the survivor held nothing of it either
        assert again.usage.prompt_tokens_details is None or again.usage.prompt_tokens_details.cached_tokens == 0
    wait_for_idle_blocks(url, colocated.worker_names, NUM_BLOCKS)


def test_evicted_blocks_leave_the_index(colocated):
    """Prompts that need more than both caches hold evict the first one everywhere: the index says so (no
    worker holds any of it at routing time, and the serving worker indeed reuses nothing), and never holds
    more blocks for a worker than its pool has."""
    url = colocated.url
    client = openai_client(colocated)
    name = client.models.list().data[0].id
    vocab = 300
    prompts = [[(97 * i + 7 * j) % vocab + 1 for j in range(400)] for i in range(16)]  # 16 x 100 blocks, distinct

    def hits(prompt) -> tuple[float, int]:
        before = routed_cached(url)
        out = client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)
        details = out.usage.prompt_tokens_details
        return routed_cached(url) - before, details.cached_tokens if details else 0

    hits(prompts[0])
    time.sleep(0.5)  # its KV events land just after its tokens
    assert hits(prompts[0])[0] >= 400 - 2 * PAGE  # held, and the index knows it
    for prompt in prompts[1:]:  # 1,500 blocks through two pools of 512: the first prompt is evicted everywhere
        hits(prompt)
    time.sleep(1.0)  # the last KV events travel with the last tokens; let them land
    for worker in colocated.worker_names:
        assert (worker_metric(url, "tandem_kv_index_blocks", worker) or 0) <= NUM_BLOCKS
    assert hits(prompts[0]) == (0, 0)
    wait_for_idle_blocks(url, colocated.worker_names, NUM_BLOCKS)


def routed_cached(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return float(re.search(r'tandem_routed_cached_prompt_tokens_total\{side="decode"\} ([0-9.e+]+)', text)[1])


def test_a_turn_under_pd_moves_only_the_blocks_its_decode_worker_lacks(tiny_checkpoint, tmp_path_factory,
                                                                     hf_reference, reference_text):
    _, tokenizer = hf_reference(tiny_checkpoint("llama"))
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("kv-pd"), num_prefill=1,
                         num_decode=2) as cluster:
        client = openai_client(cluster)
        name = client.models.list().data[0].id
        prompt: list[int] = []
        moved = []
        first = None
        warmed = 0  # leading tokens of the next prompt the prefill worker holds
        for message in conversation(tokenizer):
            prompt = prompt + message
            before, bytes_before = routed(cluster.url), worker_metric(cluster.url, "tandem_kv_transfer_bytes_total",
                                                                      "prefill-0") or 0.0
            computed_before = prompt_tokens_computed(cluster.url, "prefill-0")
            warmup_before = worker_metric(cluster.url, WARMUP, "prefill-0") or 0.0
            out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            worker = routed_to(cluster.url, before)
            first = first or worker
            assert worker == first and routed_to(cluster.url, before, "prefill") == "prefill-0"
            ids, text = reference_text(prompt, 8)
            assert out.choices[0].text == text
            deadline = time.monotonic() + 5
            while (sent := (worker_metric(cluster.url, "tandem_kv_transfer_bytes_total", "prefill-0") or 0.0)) \
                    == bytes_before:
                assert time.monotonic() < deadline, "no transfer reported"
                time.sleep(0.05)
            cached = out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0
            moved.append((sent - bytes_before, -(-len(prompt) // PAGE) - cached // PAGE))
            # the same report: the prefill worker computed only what its own cache lacked: the whole prompt
            # on the first turn, later only the new message (the last answer, which the decode worker
            # produced, was warmed into its cache after that turn), never the conversation again
            check_prompt_tokens_computed(cluster.url, "prefill-0", len(prompt) - warmed, before=computed_before)
            wait_indexed(cluster.url, first)
            warmed = wait_for_warmup(cluster.url, "prefill-0", warmup_before, len(prompt), prompt + ids)
            prompt = prompt + ids
        per_block = moved[0][0] / moved[0][1]
        for num_bytes, num_blocks in moved:  # each turn: exactly the blocks the decode worker did not hold
            assert num_bytes == pytest.approx(per_block * num_blocks)
        assert moved[2][1] < -(-len(prompt) // PAGE) // 2  # the last turn moved under half its prompt
        # every prompt's KV was received
        assert not any(worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, d) for d in ("decode-0", "decode-1"))
        wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)
