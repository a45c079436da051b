"""Scoring and fan-out on real clusters with the official openai client: ``echo`` with ``logprobs``
(the prompt's own logprobs, as lm-eval's loglikelihood tasks read them), vLLM's ``prompt_logprobs``, a
list of prompts in one completions request, n > 1 and best_of. Prompt logprobs come from the worker
that prefilled the prompt (the prefill worker under P/D, in 64-token chunks for the long prompt) and
must equal transformers' log-softmax within 1e-4; n choices come from one prefill and one KV transfer,
each seeded choice the same as the offline engine's; afterwards every block is back."""

from __future__ import annotations

import time

import openai
import pytest

from pipeline import LLM, SamplingParams
from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks, worker_metric
from tests.conftest import hf_greedy, hf_logprobs

SHAPES = {  # max_restarts: the last test kills a worker, which the launcher restarts
    "1p1d": dict(num_prefill=1, num_decode=1, max_restarts=2),
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1, max_restarts=2),
}
NUM_BLOCKS = CLUSTER_CONFIG["kv_cache"]["num_blocks"]
TOLERANCE = 1e-4
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # > 64 tokens: prefilled in several chunks


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp(f"logs-scoring-{request.param}"),
                         **SHAPES[request.param]) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, hf_reference):
    return hf_reference(tiny_checkpoint("llama"))


@pytest.fixture(autouse=True)
def blocks_come_back(cluster):
    yield
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)


def name(client) -> str:
    return client.models.list().data[0].id


def check_echoed_logprobs(logprobs, ids: list[int], model, tokenizer, num_generated: int) -> None:
    want = hf_logprobs(model, ids)
    assert len(logprobs.tokens) == len(ids) + num_generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    for position in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[position] - want[position - 1, ids[position]].item()) < TOLERANCE
        best = want[position - 1].max().item()
        assert abs(max(logprobs.top_logprobs[position].values()) - best) < TOLERANCE
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


@pytest.mark.parametrize("prompt", ["The quick brown fox jumps", LONG_PROMPT])
def test_echo_with_logprobs_scores_the_prompt(client, reference, prompt):
    model, tokenizer = reference
    ids = tokenizer(prompt)["input_ids"]
    out = client.completions.create(model=name(client), prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    check_echoed_logprobs(choice.logprobs, ids, model, tokenizer, num_generated=0)
    again = client.completions.create(model=name(client), prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert again.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs  # a prefix-cache hit computes them too


def test_echo_then_generate_as_lm_eval_asks(client, reference):
    """lm-eval's loglikelihood payload: token-id prompts in a batch, echo, logprobs=1, max_tokens=1."""
    model, tokenizer = reference
    prompts = [tokenizer(p)["input_ids"] for p in ("Paged attention keeps", "def main():\n", LONG_PROMPT)]
    out = client.completions.create(model=name(client), prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, out.choices):
        check_echoed_logprobs(choice.logprobs, ids, model, tokenizer, num_generated=1)
        first = hf_greedy(model, ids, 1)[0]
        assert choice.text == tokenizer.decode(ids) + tokenizer.decode([first])
        assert abs(choice.logprobs.token_logprobs[-1] - hf_logprobs(model, ids + [first])[-2, first].item()) < TOLERANCE
        assert choice.logprobs.text_offset[-1] == len(tokenizer.decode(ids))
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 3


def test_vllm_prompt_logprobs(client, reference):
    model, tokenizer = reference
    prompt = "Hello there, how are you?"
    ids = tokenizer(prompt)["input_ids"]
    out = client.completions.create(model=name(client), prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    want = hf_logprobs(model, ids)
    assert len(scored) == len(ids) and scored[0] is None
    for position in range(1, len(ids)):
        entry = scored[position][str(ids[position])]
        row = want[position - 1]
        assert abs(entry["logprob"] - row[ids[position]].item()) < TOLERANCE
        assert entry["rank"] == int((row > row[ids[position]]).sum()) + 1
        assert entry["decoded_token"] == tokenizer.decode([ids[position]])
        assert 2 <= len(scored[position]) <= 3
    chat = client.chat.completions.create(model=name(client), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=name(client), prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1})


def test_a_prompt_logprobs_request_reports_nothing_cached_on_a_warm_prompt(client):
    """Its prompt is computed whole to score it, wherever it runs: the decode worker's warm prefix did not save
    that compute (the 1P1D cluster reported it as cached)."""
    warm = client.completions.create(model=name(client), prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    again = client.completions.create(model=name(client), prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0, (warm.usage, again.usage)  # the prefix cache works
    scored = client.completions.create(model=name(client), prompt=LONG_PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    details = scored.usage.prompt_tokens_details
    assert details is None or details.cached_tokens == 0, scored.usage


def test_a_list_of_prompts_streams_every_choice(client, reference):
    model, tokenizer = reference
    prompts = ["Hello there, how are you?", "The quick brown fox", LONG_PROMPT, "def main():\n"]
    stream = client.completions.create(model=name(client), prompt=prompts, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts = [""] * len(prompts)
    finished = [0] * len(prompts)
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] += choice.finish_reason is not None
        usage = chunk.usage or usage
    for prompt, text in zip(prompts, texts):
        ids = tokenizer(prompt)["input_ids"]
        assert text == tokenizer.decode(hf_greedy(model, ids, 8), skip_special_tokens=True)
    assert finished == [1] * len(prompts)
    assert usage.completion_tokens == 8 * len(prompts)
    echoed = client.completions.create(model=name(client), prompt=prompts[:2], echo=True, max_tokens=3,
                                       temperature=0, stream=True)
    first_text = {}
    for chunk in echoed:
        for choice in chunk.choices:
            first_text.setdefault(choice.index, choice.text)
    assert all(first_text[i].startswith(prompts[i]) for i in range(2))


def test_one_bad_prompt_fails_the_request_and_holds_nothing(client):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=name(client), prompt=[[5, 6, 7], [10**9]], max_tokens=2)



# ------------------------------------------------------------------------------------------ n > 1
@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    """The offline engine on the same checkpoint: what every seeded choice must equal."""
    return LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 256})


def transfers_received(cluster, at_least: float = 0.0) -> float:
    """The decode worker's finished transfers, as its heartbeats report them (every 0.5 s): waits until
    the count reaches ``at_least``, then a few heartbeats more, so that a later one would show up too."""
    deadline = time.monotonic() + 30
    while (worker_metric(cluster.url, "tandem_kv_transfers_total", "decode-0") or 0.0) < at_least:
        assert time.monotonic() < deadline, "transfers not reported"
        time.sleep(0.1)
    time.sleep(1.5)
    return worker_metric(cluster.url, "tandem_kv_transfers_total", "decode-0") or 0.0


def test_n_choices_come_from_one_prefill_and_equal_the_offline_engine(cluster, client, offline, reference):
    _, tokenizer = reference
    prompt = "The quick brown fox jumps"
    ids = tokenizer(prompt)["input_ids"]
    want = offline.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=4, ignore_eos=True))[0]
    want_texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in want.choices]
    before = transfers_received(cluster) if "prefill-0" in cluster.worker_names else 0
    out = client.completions.create(model=name(client), prompt=prompt, max_tokens=10, temperature=1.0, seed=5, n=4,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == want_texts and len(set(want_texts)) == 4
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 40
    if "prefill-0" in cluster.worker_names:  # P/D: the prompt's KV crossed once, for all four choices
        assert transfers_received(cluster, at_least=before + 1) == before + 1
    stream = client.completions.create(model=name(client), prompt=prompt, max_tokens=10, temperature=1.0, seed=5, n=4,
                                       stream=True, extra_body={"ignore_eos": True})
    texts = [""] * 4
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == want_texts
    chat = client.chat.completions.create(model=name(client), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, n=3)
    assert len({c.message.content for c in chat.choices}) == 1 and [c.index for c in chat.choices] == [0, 1, 2]


def test_n_with_a_list_of_prompts_and_a_stop_string(client, offline, reference):
    _, tokenizer = reference
    prompts = ["Hello there, how are you?", "def main():\n"]
    out = client.completions.create(model=name(client), prompt=prompts, max_tokens=6, temperature=1.0, seed=1, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        want = offline.generate([tokenizer(prompt)["input_ids"]],
                                SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=2, ignore_eos=True))[0]
        assert [c.text for c in out.choices[2 * i:2 * i + 2]] == [
            tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in want.choices]
    # a stop string ends one choice at the router; the others run to their end
    full = client.completions.create(model=name(client), prompt=prompts[0], max_tokens=12, temperature=1.0, seed=3,
                                     n=3, extra_body={"ignore_eos": True})
    stop = full.choices[1].text[2:5]
    cut = client.completions.create(model=name(client), prompt=prompts[0], max_tokens=12, temperature=1.0, seed=3,
                                    n=3, stop=[stop], extra_body={"ignore_eos": True})
    for before, after in zip(full.choices, cut.choices):
        expected = before.text.split(stop)[0]
        assert after.text == expected
        assert after.finish_reason == ("stop" if stop in before.text else "length")


def test_best_of_returns_the_most_likely_candidates(cluster, client, offline, reference):
    _, tokenizer = reference
    before = transfers_received(cluster) if "prefill-0" in cluster.worker_names else 0
    prompt = "Paged attention keeps"
    candidates = offline.generate([tokenizer(prompt)["input_ids"]], SamplingParams(
        max_tokens=8, temperature=1.0, seed=7, n=4, logprobs=0, ignore_eos=True))[0].choices
    best = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:2]
    out = client.completions.create(model=name(client), prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=2,
                                    best_of=4, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and all(c.logprobs is None for c in out.choices)
    assert [c.text for c in out.choices] == [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in best]
    assert out.usage.completion_tokens == 32  # every candidate was generated
    if "prefill-0" in cluster.worker_names:  # four candidates, one prefill, one transfer
        assert transfers_received(cluster, at_least=before + 1) == before + 1
    every = client.completions.create(model=name(client), prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=4,
                                      best_of=4, extra_body={"ignore_eos": True})  # best_of == n: ranked too
    ranked = sorted(candidates, key=lambda c: -c.cumulative_logprob)
    assert [c.text for c in every.choices] == [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in ranked]


def test_a_client_leaving_mid_stream_frees_every_choice(cluster, client):
    import httpx

    body = {"model": name(client), "prompt": LONG_PROMPT, "max_tokens": 200, "n": 4, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 12:
                break  # leaving with every choice running; blocks_come_back checks the pool

# ------------------------------------------------------------------------------------------ lm-eval
MC_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Paged attention keeps", "choices": [" the cache in blocks", " nothing", " a tree"], "answer": 0},
]
ROLLING_DOCS = [{"text": "def main():\n    return 0\n"}, {"text": LONG_PROMPT}]
TASKS = {
    "tandem_mc": """task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files: {path}/mc.jsonl
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "tandem_rolling": """task: tandem_rolling
dataset_path: json
dataset_kwargs:
  data_files: {path}/rolling.jsonl
test_split: train
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""",
    "tandem_gen": """task: tandem_gen
dataset_path: json
dataset_kwargs:
  data_files: {path}/mc.jsonl
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("lm-eval-tasks")
    (path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (path / "rolling.jsonl").write_text("".join(json.dumps(d) + "\n" for d in ROLLING_DOCS))
    for task, text in TASKS.items():
        (path / f"{task}.yaml").write_text(text.format(path=path))
    return path


def lm_eval_samples(model: str, model_args: dict, tasks: list[str], task_dir, batch_size: int = 1) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=batch_size,
                              task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                              apply_chat_template=False)
    return results["samples"]


@pytest.fixture(scope="module")
def transformers_scores(tiny_checkpoint, lm_eval_tasks):
    """lm-eval's own transformers model (HFLM, fp32, CPU) on the same tasks: the reference."""
    return lm_eval_samples("hf", {"pretrained": tiny_checkpoint("llama"), "dtype": "float32", "device": "cpu"},
                           ["tandem_mc", "tandem_rolling"], lm_eval_tasks)


def test_lm_eval_loglikelihood_tasks_equal_transformers(cluster, lm_eval_tasks, transformers_scores):
    if cluster.num_prefill == 0:  # each shape's scoring is checked against transformers by the tests above
        pytest.skip("lm-eval's side is the same on every shape: run on the 1P1D cluster only (suite time)")
    served = name(openai_client(cluster))
    # no tokenizer given: lm-eval finds /tokenizer_info and /tokenize on the router and tokenizes there
    args = {"model": served, "base_url": f"{cluster.url}/v1/completions", "max_length": 2048, "num_concurrent": 2,
            "max_retries": 1}
    ours = lm_eval_samples("local-completions", args, ["tandem_mc", "tandem_rolling"], lm_eval_tasks, batch_size=4)
    for task in ("tandem_mc", "tandem_rolling"):
        assert len(ours[task]) == len(transformers_scores[task]) > 0
        for got, want in zip(sorted(ours[task], key=lambda s: s["doc_id"]),
                             sorted(transformers_scores[task], key=lambda s: s["doc_id"])):
            got_lls = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in got["resps"]]
            want_lls = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in want["resps"]]
            assert len(got_lls) == len(want_lls)
            for a, b in zip(got_lls, want_lls):
                # HFLM sums a rolling window's token logprobs in fp32: at |sum| ~ 2000 its own rounding
                # is ~1e-4, so the bound grows with the sum's size past that
                assert abs(float(a) - float(b)) < max(TOLERANCE, abs(float(b)) * 1e-6), (task, got["doc_id"], a, b)
    generated = lm_eval_samples("local-completions", args, ["tandem_gen"], lm_eval_tasks, batch_size=4)["tandem_gen"]
    assert len(generated) == len(MC_DOCS) and all(isinstance(s["resps"][0][0], str) for s in generated)


def test_a_decode_worker_killed_mid_request_fails_it_and_holds_nothing(cluster, client):
    """Last in the module: the cluster restarts the worker; the request fails (n > 1 requests do not migrate)."""
    import signal

    from tests.cluster.conftest import wait_for_restart

    victim = next(w for w in cluster.worker_names if not w.startswith("prefill"))
    stream = client.completions.create(model=name(client), prompt=LONG_PROMPT, max_tokens=400, n=4, stream=True,
                                       extra_body={"ignore_eos": True})
    old_pid = cluster.pids[victim]
    with pytest.raises(openai.APIError):
        for i, _ in enumerate(stream):
            if i == 8:
                cluster.kill(victim, signal.SIGKILL)
    wait_for_restart(cluster, victim, old_pid, timeout_s=120)  # the launcher restarts it (backoff from 1 s)
