"""The offline API as a user sees it: sampling through the engine, stops, and bad input."""

from __future__ import annotations

import pytest

from tests.conftest import assert_no_leaks
from pipeline import LLM, SamplingParams
from pipeline.config import ConfigError
from pipeline.request_validation import RequestError
from pipeline.weights import CheckpointError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), max_length=96, kv_cache={"page_size": 4, "num_blocks": 256})


@pytest.fixture(autouse=True)
def no_leaks(request):
    if "llm" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("llm").engine
    start = engine.kv_manager.num_free_blocks
    yield
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine.kv_manager, start)


PROMPTS = ["Hello there, how are you?", "The quick brown fox", "Once upon a time", "def main():"]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    noisy = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)] * 3
    batch = llm.generate(PROMPTS[:1] + [PROMPTS[1]] + PROMPTS[2:], [noisy[0], params, noisy[1], noisy[2]])
    assert batch[1].token_ids == alone
    other_seed = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95,
                                                            seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.3, top_k=1, ignore_eos=True))
    assert [g.token_ids for g in greedy] == [t.token_ids for t in top1]


def test_stop_strings_truncate_text(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert len(out.token_ids) < len(base.token_ids)
    kept = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop,
                                                     include_stop_str_in_output=True))[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]
    # vLLM: no stop string ends the output before min_tokens tokens are out (the engine's rule; the router's is
    # tests/router/test_streaming.py's)
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop],
                                                     min_tokens=len(out.token_ids)))[0]
    assert len(held.token_ids) > len(out.token_ids) and held.token_ids[:len(out.token_ids)] == out.token_ids


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # the stop token's text is left out, as the server (and vLLM) leave it, unless include_stop_str_in_output
    decode = llm.tokenizer.decode
    assert out.text == decode(base.token_ids[:first], skip_special_tokens=True)
    kept = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[stop_id], include_stop_str_in_output=True))[0]
    assert kept.text == decode(base.token_ids[: first + 1], skip_special_tokens=True) != out.text
    with_stop_string = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                 stop_token_ids=[stop_id], stop=["\x00never"]))[0]
    assert with_stop_string.text == out.text  # the text is the same whether or not stop strings are watched
    held = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[stop_id], min_tokens=first + 3))[0]
    assert len(held.token_ids) >= first + 3
    assert stop_id not in held.token_ids[: first + 3]


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    out = llm.generate([PROMPTS[0]], forced)[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    ignored = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0},
                                                        ignore_eos=True))[0]
    assert ignored.token_ids == [eos] * 10 and ignored.finish_reason == "length"


def test_max_length_caps_generation(llm):
    prompt = list(range(5, 90))
    out = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(prompt) + len(out.token_ids) == 96 and out.finish_reason == "length"


def test_a_kv_pool_shorter_than_max_length_caps_it_and_stalls_nothing(tiny_checkpoint, caplog):
    """A pool of 10 blocks of 4 holds 40 tokens of one sequence: the engine serves up to 40 (said in a warning, and
    registered with the router so), a longer prompt is refused at once, and a generation that reaches 40 ends
    "length" with the request beside it done too. A sequence longer than the pool used to wait at the head of
    the queue forever (preempted, never readmitted), stalling every request behind it."""
    with caplog.at_level("WARNING", logger="pipeline.kv_pool"):
        small = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 10})
    assert small.engine.max_length == 40
    assert "holds one sequence of 40 tokens, fewer than max_length 2048" in caplog.text
    with pytest.raises(RequestError, match="max_length=40"):
        small.generate([list(range(5, 45))], SamplingParams(max_tokens=1))
    free_at_start = small.engine.kv_manager.num_free_blocks
    outs = small.generate([list(range(5, 25)), [7, 8, 9]], SamplingParams(max_tokens=500, temperature=0.0,
                                                                          ignore_eos=True))
    assert [(len(o.prompt_token_ids) + len(o.token_ids), o.finish_reason) for o in outs] == [(40, "length")] * 2
    assert_no_leaks(small.engine.kv_manager, free_at_start)
    with pytest.raises(ConfigError, match="cannot hold a prompt and a token"):
        LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 1, "num_blocks": 2},
            speculative={"num_speculative_tokens": 1})  # 2 slots, 1 of them for the draft position


def test_token_id_prompts_and_strings_agree(llm):
    ids = llm.tokenizer(PROMPTS[3])["input_ids"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert llm.generate(PROMPTS[3], params)[0].token_ids == llm.generate(ids, params)[0].token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=-1), "max_tokens: must be >= 1"),
        (dict(temperature=-0.5), "temperature: must be >= 0"),
        (dict(top_p=0.0), r"top_p: must be in \(0, 1\]"),
        (dict(logprobs=50), "logprobs"),
    ],
)
def test_bad_sampling_params_are_clear(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_are_clear_and_leave_nothing_behind(llm):
    with pytest.raises(RequestError, match="max_length=96"):
        llm.generate([list(range(1, 97))], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match=r"token ids must be in \[0, "):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([3.5], SamplingParams())


def test_unknown_fields_and_bad_checkpoints_are_clear(tmp_path, tiny_checkpoint):
    with pytest.raises(ConfigError, match="max_batch_sise: unknown field"):
        LLM(model=tiny_checkpoint("llama"), max_batch_sise=4)
    with pytest.raises(ConfigError, match="kv_cache.page_size"):
        LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 0})
    with pytest.raises(TypeError):
        SamplingParams(max_tokenz=3)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        LLM(model=str(tmp_path))


def test_eos_ids_and_defaults_from_generation_config(tmp_path, tiny_checkpoint, hf_reference):
    """An EOS id listed only in generation_config.json ends generation, as in transformers' generate; its
    sampling defaults fill a call that passes no SamplingParams."""
    import json
    import shutil

    import torch

    model, _ = hf_reference(tiny_checkpoint("llama"))
    prompt = [5, 17, 33, 60, 9]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                pad_token_id=0)[0, len(prompt):].tolist()
    stop_at = next(t for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])  # first seen past 4 tokens
    path = tmp_path / "with-generation-config"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(eos_token_id=[config["eos_token_id"], stop_at], temperature=0.0, max_new_tokens=16)
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), kv_cache={"page_size": 4, "num_blocks": 64})
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.token_ids == greedy[:greedy.index(stop_at) + 1] and out.finish_reason == "stop"
    defaulted = llm.generate([prompt])[0]  # temperature 0 and max_new_tokens from the file
    assert defaulted.token_ids == out.token_ids
    ignored = LLM(model=str(path), kv_cache={"page_size": 4, "num_blocks": 64},
                  sampling={"generation_config": "ignore", "temperature": 0.0, "max_tokens": 3})
    assert ignored.generate([prompt])[0].token_ids == greedy[:3]  # its EOS still applies; its defaults do not
