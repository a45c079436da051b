"""Live migration on drain with Gemma 3 (local layers with an 8-token window), real processes (1 prefill + 2
decode): SIGTERM the decode worker serving most of 4 greedy streams, each far past the window, and its streams
move to the other decode worker with their KV — the global layers' blocks whole, the local layers' window only,
as a prefill worker sends them (tests/kv_transfer/test_sliding_window.py). Every stream's tokens are still
transformers' greedy ones, none was recomputed, and every block comes back on the workers that stay."""

from __future__ import annotations

import re
import signal
import threading

import httpx
import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, model_name, running_cluster, wait_for_idle_blocks
from tests.cluster.conftest import worker_metric
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)

# ~20 s on 2 shared cores (half of it starting three workers): out of the default run; the rule itself is
# checked on every run at the engine level (tests/pipeline/test_sliding_window_migration.py)
pytestmark = pytest.mark.slow

DECODERS = ["decode-0", "decode-1"]
PROMPTS = [f"stream {i}: the lighthouse keeper climbed the stairs once more" for i in range(4)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(gemma3_checkpoint, tmp_path_factory):
    config = {"drain_timeout_s": 60.0, "max_batch_size": 8, "transfer": {"heartbeat_interval_s": 0.2}}
    with running_cluster(gemma3_checkpoint("gemma3"), tmp_path_factory.mktemp("gemma3-drain"), num_prefill=1,
                         num_decode=2, config=config, entry_module="tests.cluster.slow_steps",
                         env={"TANDEM_TEST_STEP_DELAY_S": "0.03", "OMP_NUM_THREADS": "1"}) as c:
        yield c


def metric(url: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)} ([0-9.e+-]+)$", httpx.get(f"{url}/metrics", timeout=5).text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_drained_workers_streams_move_with_their_windowed_kv_and_stay_exact(cluster, gemma3_checkpoint,
                                                                            hf_reference):
    from tests.conftest import hf_greedy

    model, tokenizer = hf_reference(gemma3_checkpoint("gemma3"))
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert min(map(len, prompt_ids)) > 2 * model.config.sliding_window
    client = openai_client(cluster)
    name = model_name(client)
    tokens: dict[int, list[int]] = {}
    started = threading.Semaphore(0)

    def consume(i: int) -> None:
        got: list[int] = []
        stream = client.completions.create(model=name, prompt=prompt_ids[i], max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=0, stream=True, extra_body={"ignore_eos": True,
                                                                                "return_tokens_as_token_ids": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                before = len(got)
                got += [int(token.split(":")[1]) for token in chunk.choices[0].logprobs.tokens]
                if before < 5 <= len(got):
                    started.release()
        tokens[i] = got

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=60), "a stream did not start"
    running = {w: worker_metric(cluster.url, "tandem_worker_running_requests", w) or 0 for w in DECODERS}
    victim = max(running, key=running.get)
    cluster.kill(victim, signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=120)
    for i, ids in enumerate(prompt_ids):
        assert tokens.get(i) == hf_greedy(model, ids, MAX_TOKENS, ignore_eos=True), i
    assert metric(cluster.url, "tandem_migrations_total", '{cause="drain"}') >= 1
    assert metric(cluster.url, "tandem_migration_recomputed_tokens_total") == 0  # the KV moved, nothing replayed
    survivors = [w for w in DECODERS if w != victim] + ["prefill-0"]  # (the drained worker is gone, not restarted)
    wait_for_idle_blocks(cluster.url, survivors, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
