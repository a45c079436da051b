"""Live migration on drain, real processes (1 prefill + 2 decode): SIGTERM the decode worker serving
half of 16 live streams and each of its streams moves, with its KV, to the other decode worker over the
transfer service. No stream fails, every text is the uninterrupted one (greedy and seeded sampling with
penalties), no token is recomputed (tandem_migration_recomputed_tokens_total stays 0) while KV bytes
moved, and blocks return to the start everywhere. The longest client-side pause is printed. SIGKILL
instead: the streams migrate by replay, with the same texts."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks,
                                    wait_for_incarnation, wait_for_restart, worker_metric)

MAX_TOKENS = 120
DECODERS = ["decode-0", "decode-1"]
STREAMS = {f"greedy-{i}": dict(prompt=f"stream {i}: once upon a time in {i}", temperature=0.0) for i in range(14)}
STREAMS.update({f"seeded-{i}": dict(prompt=f"numbers {i}: 1 2 3", temperature=1.0, seed=i, presence_penalty=0.5,
                                    frequency_penalty=0.3) for i in range(2)})


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    # a long drain grace: without a handoff the streams would finish where they are, so the metrics tell
    config = {"drain_timeout_s": 60.0, "max_batch_size": 16, "transfer": {"heartbeat_interval_s": 0.2}}
    # the tests stop a decode worker three times, and the same one when it serves the most streams each
    # time: within a minute of each other, those exits are three crashes in a row to its supervisor
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("live-migration"), num_prefill=1,
                         num_decode=2, config=config, max_restarts=3, entry_module="tests.cluster.slow_steps",
                         env={"TANDEM_TEST_STEP_DELAY_S": "0.03", "OMP_NUM_THREADS": "1"}) as c:
        yield c


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(rf"^{name}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def streams_across_a_signal(cluster, sig: int, every_decoder: bool = False) -> tuple[dict, str]:
    """The 16 streams run once uninterrupted, then again with ``sig`` sent to the decode worker serving
    most of them once each has 5 tokens; returns the second run's results and that worker. Every stream
    completes with the uninterrupted text and token count (asserted here)."""
    client = openai_client(cluster)
    name = client.models.list().data[0].id
    # logprobs: a chunk per token (the tiny model's text is byte soup, which text chunks hold back)
    body = lambda key: dict(model=name, max_tokens=MAX_TOKENS, logprobs=0, extra_body={"ignore_eos": True},  # noqa: E731
                            **STREAMS[key])
    want: dict[str, tuple] = {}

    def uninterrupted(key):
        out = client.completions.create(**body(key))
        want[key] = (out.choices[0].text, out.usage.completion_tokens)

    threads = [threading.Thread(target=uninterrupted, args=(key,)) for key in STREAMS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(want) == len(STREAMS)

    results: dict[str, tuple] = {}
    started = threading.Semaphore(0)

    def consume(key):
        text, usage, num_tokens, last, longest_gap = "", None, 0, None, 0.0
        try:
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **body(key)):
                now = time.monotonic()
                if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                    text += chunk.choices[0].text
                    if last is not None:
                        longest_gap = max(longest_gap, now - last)
                    last = now
                    num_tokens += len(chunk.choices[0].logprobs.tokens)
                    if num_tokens - len(chunk.choices[0].logprobs.tokens) < 5 <= num_tokens:
                        started.release()
                elif chunk.choices:
                    text += chunk.choices[0].text
                usage = chunk.usage or usage
            results[key] = ("completed", text, usage.completion_tokens, longest_gap)
        except openai.APIError as exc:
            results[key] = ("error", repr(exc))

    threads = [threading.Thread(target=consume, args=(key,), daemon=True) for key in STREAMS]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60), f"a stream did not start: {results}"
    running = {w: worker_metric(cluster.url, "tandem_worker_running_requests", w) or 0 for w in DECODERS}
    victim = max(running, key=running.get)
    for worker in DECODERS if every_decoder else [victim]:
        cluster.kill(worker, sig)
    for t in threads:
        t.join(timeout=120)
    assert all(r[0] == "completed" for r in results.values()), results
    for key, (_, text, completion_tokens, _) in results.items():
        assert (text, completion_tokens) == want[key], key  # nothing repeated or missing; usage right
    return results, victim


def test_sigterm_moves_every_stream_with_its_kv(cluster):
    old_pids = dict(cluster.pids)
    results, victim = streams_across_a_signal(cluster, signal.SIGTERM)
    handed_off = metric(cluster.url, "tandem_migrations_total", '{cause="drain"}')
    assert handed_off >= 1
    assert metric(cluster.url, "tandem_migration_recomputed_tokens_total") == 0  # the KV moved, nothing replayed
    assert metric(cluster.url, "tandem_migration_kv_bytes_total") > 0
    assert metric(cluster.url, "tandem_migration_pause_seconds_count") == handed_off
    pause_s = metric(cluster.url, "tandem_migration_pause_seconds_sum") / handed_off
    print(f"\n{handed_off:.0f} streams handed off by {victim}, mean pause {pause_s * 1e3:.0f} ms (last token "
          f"before to first after); longest client-side gap of any stream {max(r[3] for r in results.values()) * 1e3:.0f} ms")
    wait_for_restart(cluster, victim, old_pids[victim], timeout_s=60)
    wait_for_idle_blocks(cluster.url, DECODERS + ["prefill-0"], CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=60)


def test_sigkill_replays_every_stream_elsewhere(cluster):
    """The same streams with the decode worker SIGKILLed: its KV is gone, so they migrate by replay,
    greedy and seeded alike, with the uninterrupted text."""
    for worker in DECODERS:  # the drained worker of the test before is back
        wait_for_incarnation(cluster.url, worker, cluster.pids[worker], timeout_s=60)
    old_pids = dict(cluster.pids)
    before = metric(cluster.url, "tandem_migrations_total", '{cause="worker_died"}')
    _, victim = streams_across_a_signal(cluster, signal.SIGKILL)
    assert metric(cluster.url, "tandem_migrations_total", '{cause="worker_died"}') > before
    assert metric(cluster.url, "tandem_migration_recomputed_tokens_total") > 0
    wait_for_restart(cluster, victim, old_pids[victim], timeout_s=60)
    wait_for_idle_blocks(cluster.url, DECODERS + ["prefill-0"], CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=60)


def test_when_every_decode_worker_drains_the_streams_finish_where_they_are(cluster):
    """Both decode workers get SIGTERM at once: neither can take the other's streams (a handoff the other
    refuses comes back), so each finishes its own within drain_timeout_s, with the uninterrupted text."""
    for worker in DECODERS:
        wait_for_incarnation(cluster.url, worker, cluster.pids[worker], timeout_s=60)
    old_pids = {worker: cluster.pids[worker] for worker in DECODERS}
    before = metric(cluster.url, "tandem_migration_recomputed_tokens_total")
    streams_across_a_signal(cluster, signal.SIGTERM, every_decoder=True)
    assert metric(cluster.url, "tandem_migration_recomputed_tokens_total") == before  # nothing replayed
    for worker in DECODERS:  # they exit once their streams are done; their supervisor starts them again
        wait_for_restart(cluster, worker, old_pids[worker], timeout_s=60)
    wait_for_idle_blocks(cluster.url, DECODERS + ["prefill-0"], CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=60)
