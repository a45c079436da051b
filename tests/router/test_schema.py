"""router.openai_schema + router.preprocess: bodies become (prompt ids, SamplingParams) or a 400/404."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.config import SamplingConfig
from router.errors import APIError
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.preprocess import prepare_chat, prepare_completion

DEFAULTS = SamplingConfig(max_tokens=20)


def completions(served_model, **body):
    body.setdefault("model", "tiny")
    body.setdefault("prompt", "Hello")
    return prepare_completion(CompletionRequest.model_validate(body), served_model, DEFAULTS)


def completion(served_model, **body):
    prepared = completions(served_model, **body)
    assert len(prepared) == 1
    return prepared[0]


def chat(served_model, **body):
    body.setdefault("model", "tiny")
    body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    [prepared] = prepare_chat(ChatCompletionRequest.model_validate(body), served_model, DEFAULTS)
    return prepared


def api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


def test_completion_prompt_forms(served_model):
    ids = served_model.tokenizer.encode("Hello")
    assert completion(served_model).prompt_token_ids == ids
    assert completion(served_model, prompt=["Hello"]).prompt_token_ids == ids
    assert completion(served_model, prompt=[5, 6, 7]).prompt_token_ids == [5, 6, 7]
    assert completion(served_model, prompt=[[5, 6]]).prompt_token_ids == [5, 6]


def test_a_list_of_prompts_is_one_request_each(served_model):
    ids = served_model.tokenizer.encode("Hello")
    batch = completions(served_model, prompt=["Hello", "Hello"], max_tokens=3, seed=4)
    assert [p.prompt_token_ids for p in batch] == [ids, ids] and all(p.params.max_tokens == 3 for p in batch)
    assert [p.prompt_token_ids for p in completions(served_model, prompt=[[5, 6], [7]])] == [[5, 6], [7]]
    error = api_error(completions, served_model, prompt=[[5, 6], []])
    assert error.param == "prompt" and "empty" in error.message


def test_echo_and_prompt_logprobs(served_model):
    ids = served_model.tokenizer.encode("Hello")
    scored = completion(served_model, echo=True, logprobs=2, max_tokens=0)
    assert scored.params.max_tokens == 1 and scored.params.prompt_logprobs == 2
    assert scored.prompt.echo_text == "Hello" and scored.prompt.discard_output and scored.prompt.token_ids == ids
    assert completion(served_model, echo=True, prompt=[5, 6]).prompt.echo_text == served_model.tokenizer.decode([5, 6])
    assert completion(served_model, echo=True).params.prompt_logprobs is None  # echo without logprobs: text only
    both = completion(served_model, echo=True, logprobs=1, prompt_logprobs=4)
    assert both.params.prompt_logprobs == 4 and both.prompt.num_top_echo == 1
    assert chat(served_model, prompt_logprobs=0).params.prompt_logprobs == 0
    assert api_error(completion, served_model, max_tokens=0).param == "max_tokens"
    assert api_error(completion, served_model, prompt_logprobs=21).param == "prompt_logprobs"
    assert api_error(completion, served_model, prompt_logprobs=1, stream=True).param == "prompt_logprobs"
    assert api_error(chat, served_model, prompt_logprobs=1, stream=True).param == "prompt_logprobs"


def test_sampling_fields_map_to_sampling_params(served_model):
    p = completion(served_model, max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, seed=7, stop="\n",
                   logprobs=2, frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2,
                   logit_bias={"5": 10}, min_tokens=2, ignore_eos=True, stop_token_ids=[9], user="u").params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.0, 0.5, 3, 0.1, 7)
    assert p.stop == ["\n"] and p.logprobs == 2 and p.logit_bias == {5: 10.0} and p.stop_token_ids == [9]
    assert (p.min_tokens, p.ignore_eos, p.repetition_penalty) == (2, True, 1.2)


def test_defaults_come_from_the_config_and_fit_the_context(served_model):
    p = completion(served_model).params
    assert (p.max_tokens, p.temperature, p.top_p) == (20, 1.0, 1.0)
    long_prompt = [5] * 60  # max_length is 64: only 4 tokens of room
    assert completion(served_model, prompt=long_prompt).params.max_tokens == 4
    # max_tokens left out and not set by the operator: the rest of the context (as vLLM's chat endpoint)
    request = CompletionRequest.model_validate({"model": "tiny", "prompt": [5] * 10})
    [unbounded] = prepare_completion(request, served_model, SamplingConfig())
    assert unbounded.params.max_tokens == 64 - 10


def test_chat_fields(served_model):
    prepared = chat(served_model, max_completion_tokens=3, max_tokens=9, logprobs=True, top_logprobs=2)
    assert prepared.params.max_tokens == 3 and prepared.params.logprobs == 2 and prepared.want_logprobs
    assert chat(served_model, logprobs=True).params.logprobs == 0
    assert chat(served_model).params.logprobs is None
    parts = chat(served_model, messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                                      {"type": "text", "text": "lo"}]}])
    joined = chat(served_model, messages=[{"role": "user", "content": "Hel\nlo"}])  # as vLLM joins them
    assert parts.prompt_token_ids == joined.prompt_token_ids


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [5] * 64}, "prompt"),
        ({"prompt": [5] * 60, "max_tokens": 10}, "max_tokens"),
    ],
)
def test_bad_values_are_400_naming_the_field(served_model, body, param):
    error = api_error(completion, served_model, **body)
    assert error.status_code == 400 and error.param == param, error.message


def test_too_long_message_gives_the_numbers(served_model):
    error = api_error(completion, served_model, prompt=[5] * 60, max_tokens=10)
    assert "64" in error.message and "70" in error.message and "60" in error.message
    assert error.code == "context_length_exceeded"


def test_unknown_model_is_404(served_model):
    error = api_error(completion, served_model, model="gpt-4")
    assert error.status_code == 404 and error.code == "model_not_found" and "gpt-4" in error.message


def test_chat_specific_errors(served_model):
    assert api_error(chat, served_model, top_logprobs=2).param == "top_logprobs"
    assert api_error(chat, served_model, logprobs=True, top_logprobs=30).param == "top_logprobs"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "x", "n": "two"},
        {"model": "tiny", "prompt": ["a"] * 1025},
        {"model": "tiny", "prompt": "x", "echo": "yes"},
        {"model": "tiny", "prompt": "x", "max_tokens": "ten"},
        {"model": "tiny", "prompt": "x", "max_tokens": 1.5},
        {"model": "tiny", "prompt": "x", "stream": "yes"},
        {"model": "tiny"},
        {"prompt": "x"},
        {"model": "tiny", "prompt": {"a": 1}},
    ],
)
def test_bad_shapes_fail_schema_validation(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "messages": []},
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 3},
    ],
)
def test_bad_chat_shapes_fail_schema_validation(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_a_lone_surrogate_is_a_400(served_model):
    assert api_error(completion, served_model, prompt="a\ud800b").param == "prompt"
    assert api_error(completion, served_model, prompt=["fine", "a\udfffb"]).param == "prompt"
    assert api_error(chat, served_model, messages=[{"role": "user", "content": "a\ud800b"}]).param == "messages"
    assert api_error(completion, served_model, stop=["a\ud800"]).param == "stop"


def test_chat_template_options_render_as_transformers_does(served_model):
    tokenizer = served_model.tokenizer
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]

    def want(**kwargs):
        out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    got = chat(served_model, messages=messages, chat_template=template, chat_template_kwargs={"enable_thinking": False})
    assert got.prompt_token_ids == want(chat_template=template, enable_thinking=False, add_generation_prompt=True)
    assert got.prompt_token_ids != chat(served_model, messages=messages, chat_template=template).prompt_token_ids
    continued = chat(served_model, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert continued.prompt_token_ids == want(add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(continued.prompt_token_ids).rstrip().endswith("Hello th")
    error = api_error(chat, served_model, messages=messages, continue_final_message=True)
    assert error.param == "messages" and "add_generation_prompt" in error.message


def test_the_checkpoints_generation_config_fills_unset_fields(served_model):
    import dataclasses

    recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                   "max_new_tokens": 12, "do_sample": True, "eos_token_id": [2, 7]}
    model = dataclasses.replace(served_model, generation_config=recommended)

    def params(defaults=DEFAULTS, **body):
        request = CompletionRequest.model_validate({"model": "tiny", "prompt": "Hello", **body})
        [prepared] = prepare_completion(request, model, defaults)
        return prepared.params

    p = params(SamplingConfig())
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.95, 20, 0.05,
                                                                                              1.1, 12)
    assert params(temperature=0.0, top_k=-1).temperature == 0.0 and params(top_k=-1).top_k == -1  # the request wins
    assert params().max_tokens == 20  # DEFAULTS sets max_tokens: the operator's choice beats the checkpoint's
    ignored = params(SamplingConfig(generation_config="ignore"))
    assert (ignored.temperature, ignored.top_k, ignored.max_tokens) == (1.0, -1, 60)  # the rest of the context
