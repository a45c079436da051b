"""router.streaming.OutputBuilder: UTF-8-safe text, stop strings, hidden stop tokens, logprob shapes."""

from __future__ import annotations

import queue as queue_module
import threading

import httpx
import msgspec
import pytest

from pipeline.protocol.cluster import FinishCode, TokenDelta
from pipeline.protocol.requests import SamplingParams, TokenLogprob
from router.streaming import ChoiceResult, OutputBuilder, ResponseShape, chat_logprobs, completion_logprobs


def deltas(ids, finish=FinishCode.LENGTH, stop_token_id=None, is_eos=False):
    out = [TokenDelta(request_id="r", token_ids=[t]) for t in ids]
    out[-1].finish_reason = finish
    out[-1].stop_token_id, out[-1].is_eos = stop_token_id, is_eos
    return out


def run(builder, ds):
    pieces = [builder.add(d) for d in ds]
    return "".join(p.text for p in pieces), pieces


def test_text_matches_a_full_decode(served_model):
    text = "Hello there, how are you? Paris is the capital of France."
    ids = served_model.tokenizer.encode(text)
    builder = OutputBuilder(served_model, SamplingParams(max_tokens=100), 5)
    out, pieces = run(builder, deltas(ids))
    assert out == served_model.tokenizer.decode(ids) == text
    assert pieces[-1].finish_reason == "length" and builder.usage()["completion_tokens"] == len(ids)


def test_stop_string_truncates_and_never_leaks_held_back_text(served_model):
    text = "Hello there, how are you? Paris is the capital of France."
    ids = served_model.tokenizer.encode(text)
    builder = OutputBuilder(served_model, SamplingParams(max_tokens=100, stop=["how are"]), 5)
    emitted = ""
    for d in deltas(ids):
        piece = builder.add(d)
        emitted += piece.text
        assert "how" not in emitted  # the text before the stop is never overtaken by held-back text
        if piece.finish_reason:
            break
    assert emitted == "Hello there, "
    assert piece.finish_reason == "stop" and piece.stop_reason == "how are" and piece.matched_stop_string
    assert builder.add(TokenDelta(request_id="r", token_ids=[5])).text == ""  # finished: ignores late tokens


def test_no_stop_string_ends_the_first_min_tokens_tokens(served_model):
    """vLLM's rule (and the worker's): a stop string is looked for only once more than min_tokens tokens are out."""
    text = "Hello there, how are you? Over there."
    ids = served_model.tokenizer.encode(text)
    first_there = next(k for k in range(1, len(ids) + 1) if "there" in served_model.tokenizer.decode(ids[:k]))
    for min_tokens, expected in ((first_there - 1, "Hello "), (first_there, "Hello there, how are you? Over ")):
        builder = OutputBuilder(served_model, SamplingParams(max_tokens=100, stop=["there"], min_tokens=min_tokens), 5)
        out, pieces = run(builder, deltas(ids))
        assert out == expected and builder.finish_reason == "stop", min_tokens


def test_stop_string_included_when_asked(served_model):
    ids = served_model.tokenizer.encode("Hello there, how are you?")
    builder = OutputBuilder(served_model, SamplingParams(stop=["there"], include_stop_str_in_output=True), 5)
    out, _ = run(builder, deltas(ids))
    assert out == "Hello there"


def test_final_stop_token_is_counted_but_not_rendered(served_model):
    tok = served_model.tokenizer
    ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<|user|>")]
    builder = OutputBuilder(served_model, SamplingParams(skip_special_tokens=False), 5)
    out, pieces = run(builder, deltas(ids, FinishCode.STOP, stop_token_id=ids[-1]))
    assert out == "Hello" and pieces[-1].finish_reason == "stop" and pieces[-1].stop_reason == ids[-1]
    assert builder.usage() == {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids)}
    # an EOS ends the same way, with no stop reason (vLLM: stop_reason null for EOS, the id for stop_token_ids)
    builder = OutputBuilder(served_model, SamplingParams(skip_special_tokens=False), 5)
    out, pieces = run(builder, deltas(ids, FinishCode.STOP, stop_token_id=ids[-1], is_eos=True))
    assert out == "Hello" and pieces[-1].finish_reason == "stop" and pieces[-1].stop_reason is None
    # include_stop_str_in_output keeps the stop token's text, as vLLM's detokenizer does
    kept = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    builder = OutputBuilder(served_model, kept, 5)
    out, pieces = run(builder, deltas(ids, FinishCode.STOP, stop_token_id=ids[-1]))
    assert out == "Hello<|user|>" and pieces[-1].stop_reason == ids[-1]


def test_the_stop_token_has_a_logprob_entry_as_every_counted_token(served_model):
    """vLLM lists the EOS (or a stop_token_ids token) in logprobs too: one entry per completion token, the stop
    token's at the end of the text it does not add to."""
    tok = served_model.tokenizer
    ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<|user|>")]
    builder = OutputBuilder(served_model, SamplingParams(logprobs=0, skip_special_tokens=False), 5)
    stream = deltas(ids, FinishCode.STOP, stop_token_id=ids[-1])
    for position, delta in enumerate(stream):
        delta.logprobs = [[TokenLogprob(ids[position], -0.5 - position)]]
    out, pieces = run(builder, stream)
    entries = [entry for piece in pieces for entry in piece.logprobs]
    assert out == "Hello" and len(entries) == len(ids) == builder.usage()["completion_tokens"]
    assert entries[-1].logprob == -0.5 - (len(ids) - 1) and entries[-1].text_offset == len("Hello")


def test_errors_and_aborts_surface_as_errors(served_model):
    builder = OutputBuilder(served_model, SamplingParams(), 5)
    piece = builder.add(TokenDelta(request_id="r", finish_reason=FinishCode.ERROR, error="KV transfer failed"))
    assert piece.error == "KV transfer failed" and builder.is_finished


def test_logprob_shapes(served_model):
    tok = served_model.tokenizer
    ids = tok.encode("Hello there")
    builder = OutputBuilder(served_model, SamplingParams(logprobs=1), 5)
    entries = []
    for i, t in enumerate(ids):
        d = TokenDelta(request_id="r", token_ids=[t], logprobs=[[TokenLogprob(t, -0.25), TokenLogprob(7, -float("inf"))]])
        entries += builder.add(d).logprobs
    comp = completion_logprobs(entries)
    assert "".join(comp["tokens"]) == "Hello there"
    assert comp["token_logprobs"] == [-0.25] * len(ids)
    assert comp["text_offset"][0] == 0 and comp["text_offset"] == sorted(comp["text_offset"])
    assert comp["top_logprobs"][0] == {comp["tokens"][0]: -0.25, served_model.token_text(7): -9999.0}
    chat = chat_logprobs(entries)["content"]
    assert chat[0]["token"] == comp["tokens"][0] and chat[0]["bytes"] == list(chat[0]["token"].encode())
    assert chat[0]["top_logprobs"] == [{"token": served_model.token_text(7), "logprob": -9999.0,
                                       "bytes": list(served_model.token_text(7).encode())}]


def test_response_shapes():
    shape = ResponseShape("chat", "chatcmpl-1", "tiny", want_logprobs=False)
    from router.streaming import Piece

    first = shape.chunk(Piece(), first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = shape.chunk(Piece(text="x", finish_reason="stop"))
    assert last["choices"][0]["delta"] == {"content": "x"} and last["choices"][0]["finish_reason"] == "stop"
    assert shape.usage_chunk({"prompt_tokens": 1})["choices"] == []
    full = ResponseShape("completion", "cmpl-1", "tiny", True).full([ChoiceResult(0, "hi", [], "length", None)], {})
    assert full["object"] == "text_completion" and full["choices"][0]["text"] == "hi"
    assert full["choices"][0]["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_echo_puts_the_prompt_and_its_logprobs_first(served_model):
    from pipeline.protocol.requests import PromptLogprobs
    from router.streaming import PromptRendering

    prompt_ids = served_model.tokenizer.encode("Hello there")
    scored = PromptLogprobs([-1.5] * (len(prompt_ids) - 1), [2] * (len(prompt_ids) - 1),
                            [[TokenLogprob(7, -0.5)] for _ in prompt_ids[1:]])
    rendering = PromptRendering(prompt_ids, echo_text="Hello there", num_top_echo=1, num_top_prompt_logprobs=0)
    builder = OutputBuilder(served_model, SamplingParams(logprobs=1), len(prompt_ids), rendering)
    out = served_model.tokenizer.encode(" you")
    first = TokenDelta(request_id="r", token_ids=out[:1], logprobs=[[TokenLogprob(out[0], -0.25)]],
                       prompt_logprobs=scored, finish_reason=FinishCode.LENGTH)
    piece = builder.add(first)
    assert piece.text == "Hello there" + served_model.tokenizer.decode(out[:1])
    comp = completion_logprobs(piece.logprobs)
    assert comp["token_logprobs"] == [None] + [-1.5] * (len(prompt_ids) - 1) + [-0.25]
    assert comp["top_logprobs"][0] is None and len(comp["top_logprobs"][1]) == 2
    assert comp["text_offset"][len(prompt_ids)] == len("Hello there")
    assert piece.prompt_logprobs[0] is None
    assert piece.prompt_logprobs[1] == {str(prompt_ids[1]): {"logprob": -1.5, "rank": 2,
                                                              "decoded_token": served_model.token_text(prompt_ids[1])}}


def test_max_tokens_zero_shows_the_prompt_alone(served_model):
    from router.streaming import PromptRendering

    prompt_ids = served_model.tokenizer.encode("Hello")
    rendering = PromptRendering(prompt_ids, echo_text="Hello", discard_output=True)
    builder = OutputBuilder(served_model, SamplingParams(max_tokens=1), len(prompt_ids), rendering)
    piece = builder.add(TokenDelta(request_id="r", token_ids=[9], finish_reason=FinishCode.STOP, stop_token_id=9))
    assert piece.text == "Hello" and piece.finish_reason == "length"
    assert builder.usage()["completion_tokens"] == 0


def test_a_chat_streams_role_chunk_comes_with_its_first_token(router, served_model):
    """Nothing is streamed before the first token: a client timing TTFT (vllm bench serve's chat backend counts the
    first chunk with choices) would otherwise time the role chunk, sent before the prompt was computed."""
    from tests.router.fake_worker import held

    worker = router.add_worker(script=held)
    chunks: queue_module.Queue = queue_module.Queue()

    def read():
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.put(msgspec.json.decode(line[6:]))
    reader = threading.Thread(target=read)
    reader.start()
    assert worker.wait_for(lambda: bool(worker.requests))
    with pytest.raises(queue_module.Empty):
        chunks.get(timeout=0.5)  # the prompt is being "computed": nothing yet
    ids = served_model.tokenizer.encode("Hello")
    worker.emit(TokenDelta(request_id=worker.requests[0].request_id, token_ids=ids, finish_reason=FinishCode.STOP))
    reader.join(30)
    first = chunks.get(timeout=5)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    rest = []
    while not chunks.empty():
        rest.append(chunks.get())
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in rest) == "Hello"


def test_the_worker_says_whether_its_stop_token_is_an_eos():
    from pipeline.step_output import StepOutput
    from pipeline.worker_base import delta_from_step

    eos = delta_from_step(StepOutput("r", [7, 2], finish_reason="stop", stop_reason=None, is_stop_token=True))
    stop_id = delta_from_step(StepOutput("r", [7, 9], finish_reason="stop", stop_reason=9, is_stop_token=True))
    assert (eos.stop_token_id, eos.is_eos) == (2, True) and (stop_id.stop_token_id, stop_id.is_eos) == (9, False)


def test_echo_offsets_around_characters_of_several_tokens(served_model):
    """``text_offset[i]`` is where token i starts in the text: the tokens of one character (several bytes, each a
    token of a byte-level vocabulary) share its offset, and offsets never go back."""
    from pipeline.protocol.requests import PromptLogprobs
    from router.streaming import PromptRendering

    text = "aé日b"
    prompt_ids = served_model.tokenizer.encode(text)
    assert len(prompt_ids) > len(text)  # some character takes several tokens here
    scored = PromptLogprobs([-1.0] * (len(prompt_ids) - 1), [1] * (len(prompt_ids) - 1),
                            [[] for _ in prompt_ids[1:]])
    rendering = PromptRendering(prompt_ids, echo_text=text, num_top_echo=0)
    builder = OutputBuilder(served_model, SamplingParams(logprobs=0), len(prompt_ids), rendering)
    out = served_model.tokenizer.encode("x")[-1:]
    piece = builder.add(TokenDelta(request_id="r", token_ids=out, logprobs=[[TokenLogprob(out[0], -0.5)]],
                                   prompt_logprobs=scored, finish_reason=FinishCode.LENGTH))
    offsets = completion_logprobs(piece.logprobs)["text_offset"]
    assert offsets == sorted(offsets) and offsets[-2] == text.index("b") and offsets[-1] == len(text)
    for token_id, offset in zip(prompt_ids, offsets):  # each token's text (when whole) is found at its offset
        token = served_model.tokenizer.decode([token_id], skip_special_tokens=True)
        assert "\ufffd" in token or text.startswith(token, offset), (token, offset)


def test_chat_logprob_bytes_are_each_tokens_own_bytes(served_model):
    """A token that ends inside a character decodes to U+FFFD; its ``bytes`` are still its own, so a client that
    joins the bytes of the tokens gets the text back (OpenAI's reason for the field)."""
    text = "é日本x"
    ids = served_model.tokenizer.encode(text, add_special_tokens=False)
    assert any(served_model.token_text(t) == "\ufffd" for t in ids)  # some token is part of a character here
    builder = OutputBuilder(served_model, SamplingParams(logprobs=1), 5)
    entries = []
    for t in ids:
        entries += builder.add(TokenDelta(request_id="r", token_ids=[t],
                                          logprobs=[[TokenLogprob(t, -0.5), TokenLogprob(ids[0], -1.0)]])).logprobs
    content = chat_logprobs(entries)["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode("utf-8") == text
    assert all(item["top_logprobs"][0]["bytes"] == content[0]["bytes"] for item in content)


def test_a_sentencepiece_byte_fallback_token_gives_its_byte():
    from types import SimpleNamespace

    from router.token_bytes import token_bytes

    vocab = {5: "<0xC3>", 6: "▁the", 7: "<0xA9>"}
    tokenizer = SimpleNamespace(convert_ids_to_tokens=vocab.get)
    assert token_bytes(tokenizer, 5, "\ufffd") == b"\xc3" and token_bytes(tokenizer, 7, "\ufffd") == b"\xa9"
    assert token_bytes(tokenizer, 6, " the") == b" the"  # whole characters: the text's UTF-8
