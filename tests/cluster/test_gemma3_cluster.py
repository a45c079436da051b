"""A Gemma 3 checkpoint (local layers with an 8-token window among global ones) served by real processes:
colocated, and 1P1D with every prompt prefilled on the prefill worker and its KV sent to the decode worker.
Prompts are longer than the window. Greedy completions must be transformers' own, token for token, with its
logprobs (1e-4); afterwards every KV block is back. Under P/D a local layer's KV outside its window never
travels: the bytes moved are the formula's, and a later prompt sharing the prefix is still exact."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, check_greedy_against_transformers, openai_client, model_name,
                                    running_cluster, sent_kv_bytes_after, wait_for_idle_blocks, windowed_kv_bytes,
                                    worker_metric)
from tests.gemma_checkpoints import LOCAL_LAYERS, gemma3_checkpoint  # noqa: F401 (a fixture)

SHAPES = {
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    "1p1d": dict(num_prefill=1, num_decode=1),  # router.max_local_prefill_length 0: no prompt prefilled locally
}
PROMPTS = [
    "Paged attention keeps the key and value cache in fixed-size blocks, so memory is never fragmented.",
    "Once upon a time, in a small town by the sea, there lived a baker who rose before the sun.",
    "def main():\n",
]
NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, gemma3_checkpoint, tmp_path_factory):
    with running_cluster(gemma3_checkpoint("gemma3"), tmp_path_factory.mktemp(f"gemma3-{request.param}"),
                         **SHAPES[request.param]) as running:
        yield request.param, running


def test_greedy_completions_match_transformers(cluster, gemma3_checkpoint, hf_reference):
    shape, running = cluster
    model, tokenizer = hf_reference(gemma3_checkpoint("gemma3"))
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert max(map(len, prompt_ids)) > 2 * model.config.sliding_window
    check_greedy_against_transformers(running, model, tokenizer, prompt_ids, NUM_NEW_TOKENS,
                                      is_remote_prefill=shape == "1p1d")


# Not sent before in this module, so neither worker's prefix cache holds it: more than twice the window.
LONG_PROMPT = ("Sliding window attention lets each local layer look back only a few tokens, while the global "
               "layers see the whole prompt from its very first token.")
KV_BYTES = "tandem_kv_transfer_bytes_total"


def test_local_layers_send_only_their_window_and_a_shared_prefix_stays_exact(cluster, gemma3_checkpoint, hf_reference):
    """1P1D: prompts of twice the window and far past it move the global layers' blocks whole and the local
    layers' last window only, and their completions are transformers' own. The decode worker keeps those
    requests' blocks out of its prefix cache: a prompt sharing the long one's start but ending before its window
    (whose local layers would read exactly the blocks that never came) is exact too, for both of its greedy
    choices (forked on the decode worker), and its KV is sent again in full."""
    from tests.conftest import hf_greedy

    shape, running = cluster
    if shape != "1p1d":
        pytest.skip("a colocated worker moves no KV")
    model, tokenizer = hf_reference(gemma3_checkpoint("gemma3"))
    config = model.config
    long_ids = tokenizer(LONG_PROMPT)["input_ids"]
    assert len(long_ids) >= 3 * config.sliding_window
    for ids in (long_ids[: 2 * config.sliding_window], long_ids):  # twice the window, then far past it
        before = worker_metric(running.url, KV_BYTES, "prefill-0") or 0.0
        check_greedy_against_transformers(running, model, tokenizer, [ids], NUM_NEW_TOKENS, is_remote_prefill=True)
        windowed, whole = windowed_kv_bytes(config, LOCAL_LAYERS["gemma3"], len(ids))
        assert windowed < whole
        sent = sent_kv_bytes_after(running.url, "prefill-0", before, windowed)
        print(f"{len(ids)}-token prompt: {sent:.0f} KV bytes sent, {whole} with every layer whole")
        assert sent == windowed, f"all layers whole would be {whole}"

    branch_ids = long_ids[: len(long_ids) - 2 * config.sliding_window] + tokenizer(" and then")["input_ids"]
    before = worker_metric(running.url, KV_BYTES, "prefill-0") or 0.0
    client = openai_client(running)
    out = client.completions.create(model=model_name(client), prompt=branch_ids, max_tokens=NUM_NEW_TOKENS,
                                    temperature=0, n=2, logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    want = hf_greedy(model, branch_ids, NUM_NEW_TOKENS, ignore_eos=False)
    for choice in out.choices:
        assert [int(token.split(":")[1]) for token in choice.logprobs.tokens] == want
    # a second choice shares the full blocks before the last prompt token and computes from there itself
    page_size = CLUSTER_CONFIG["kv_cache"]["page_size"]
    fork_start = (len(branch_ids) - 1) // page_size * page_size
    want_bytes, _ = windowed_kv_bytes(config, LOCAL_LAYERS["gemma3"], len(branch_ids), fork_start)
    assert sent_kv_bytes_after(running.url, "prefill-0", before, want_bytes) == want_bytes
    wait_for_idle_blocks(running.url, running.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
