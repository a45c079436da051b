"""A migrated request resumes exactly: an engine given the prompt and the first k output tokens
(``resume_token_ids``) produces the rest as the uninterrupted request would have, greedy, seeded
sampling with penalties, and under a grammar; what cannot resume is a clear error."""

from __future__ import annotations

import json

import pytest

from pipeline import LLM, SamplingParams
from pipeline.engine import RequestError
from pipeline.protocol import StructuredOutput
from tests.conftest import assert_no_leaks
from tests.pipeline.test_engine_exactness import make_prompts

SCHEMA = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["x", "yy", "zzz"]}}}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 256})


def run(engine, request_id, prompt, params, resume=None) -> list[int]:
    engine.add_request(request_id, prompt, params, resume_token_ids=resume)
    tokens = list(resume or [])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded with penalties": SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True,
                                            presence_penalty=0.8, frequency_penalty=0.5, min_tokens=20),
    "grammar": SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                              structured_output=StructuredOutput(kind="json", value=json.dumps(SCHEMA))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_resumed_request_goes_on_exactly(llm, case, cut):
    engine = llm.engine
    free = engine.kv_manager.num_free_blocks
    prompt = make_prompts(300, [11], seed=cut)[0]
    params = CASES[case]
    whole = run(engine, f"whole-{case}-{cut}", prompt, params)
    assert len(whole) > cut
    resumed = run(engine, f"resumed-{case}-{cut}", prompt, params, resume=whole[:cut])
    assert resumed == whole
    if case == "grammar":
        json.loads(llm.tokenizer.decode(resumed, skip_special_tokens=True))
    assert_no_leaks(engine.kv_manager, free)


def test_what_cannot_resume_is_refused(llm):
    engine = llm.engine
    prompt = make_prompts(300, [6])[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    for params, resume, words in [
        (greedy, [5, 6, 7, 8], "nothing is left"),
        (SamplingParams(max_tokens=8, n=2), [5], "single-choice"),
        (greedy, [10**6], "outside the vocabulary"),
        (CASES["grammar"], [5], "constraint"),
    ]:
        with pytest.raises(RequestError, match=words):
            engine.add_request("bad", prompt, params, resume_token_ids=resume)
        assert not engine.has_unfinished_requests()
