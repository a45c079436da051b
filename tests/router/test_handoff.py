"""Live migration as the router sees it, with scripted DecodeOnly workers on real sockets: a draining
worker's offer moves the stream to another DecodeOnly worker with ``kv_source_request_id`` (nothing to
recompute); with nowhere to go the offer is declined and the stream decodes on where it was; a source
that dies before the new worker's first tokens turns the handoff into a migration by replay; a target that
refuses the stream hands it back to its source."""

from __future__ import annotations

import threading

import openai

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import FinishCode, HandoffOffer, TokenDelta, encode
from tests.router.fake_worker import held, tokens_script

BODY = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
DECODE = PipelineRole.DecodeOnly


def stream_in_background(router) -> dict:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=20)
    result: dict = {}

    def consume():
        text, usage = "", None
        try:
            for chunk in client.completions.create(**BODY):
                text += chunk.choices[0].text if chunk.choices else ""
                usage = chunk.usage or usage
            result.update(text=text, completion_tokens=usage.completion_tokens)
        except openai.APIError as exc:
            result.update(error=repr(exc))

    result["thread"] = threading.Thread(target=consume, daemon=True)
    result["thread"].start()
    return result


def start_on(source, ids: list[int], num_sent: int) -> str:
    """The stream reached ``source``; it emits ``num_sent`` tokens, pauses and offers the stream."""
    assert source.wait_for(lambda: source.requests)
    wire_id = source.requests[0].request_id
    source.emit(*(TokenDelta(request_id=wire_id, token_ids=[t], num_prompt_tokens=1 if i == 0 else 0)
                  for i, t in enumerate(ids[:num_sent])))
    source.send_raw(encode(HandoffOffer(worker_id=source.worker_id, request_id=wire_id, endpoint="ipc:///handoff")))
    return wire_id


def rest_after_resume(ids: list[int], only_replay: bool = False):
    def script(request):
        if only_replay and request.kv_source_request_id is not None:
            return []  # never gets the KV: its source dies first
        done = len(request.resume_token_ids)
        assert request.resume_token_ids == ids[:done]
        return tokens_script(ids[done:], step_s=0.005)(request)
    return script


def decode_on_in_place(source, wire_id: str, ids: list[int], num_sent: int) -> None:
    """A declined stream decodes on where it is: the rest of ``ids`` from ``source``."""
    source.emit(*(TokenDelta(request_id=wire_id, token_ids=[t],
                             finish_reason=FinishCode.LENGTH if i == len(ids) - 1 else None)
                  for i, t in enumerate(ids) if i >= num_sent))


def test_an_offered_stream_moves_with_its_kv(router, served_model):
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is")[:12]
    source = router.add_worker("a-source", script=held, role=DECODE)  # ties go to the lower id
    target = router.add_worker("b-target", script=rest_after_resume(ids), role=DECODE)
    result = stream_in_background(router)
    wire_id = start_on(source, ids, 4)
    result["thread"].join(timeout=20)
    assert result.get("text") == served_model.tokenizer.decode(ids), result
    assert result["completion_tokens"] == len(ids)
    [moved] = target.requests
    assert moved.kv_source_request_id == wire_id and moved.prefill_endpoint == "ipc:///handoff"
    assert moved.resume_token_ids == ids[:4] and moved.request_id != wire_id
    assert router.metric('tandem_migrations_total{cause="drain"}') == 1.0
    assert router.metric("tandem_migration_recomputed_tokens_total") == 0.0
    assert router.metric("tandem_migration_pause_seconds_count") == 1.0
    assert source.declined == [] and source.cancels == []


def test_an_offer_with_nowhere_to_go_is_declined(router, served_model):
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is")[:12]
    source = router.add_worker("a-alone", script=held, role=DECODE)
    router.add_worker("b-colocated", script=held)  # colocated workers cannot receive KV
    result = stream_in_background(router)
    wire_id = start_on(source, ids, 4)
    assert source.wait_for(lambda: source.declined == [wire_id])
    decode_on_in_place(source, wire_id, ids, 4)
    result["thread"].join(timeout=20)
    assert result.get("text") == served_model.tokenizer.decode(ids), result
    assert router.metric('tandem_migrations_total{cause="drain"}') == 0.0
    assert router.metric("tandem_handoffs_declined_total") == 1.0


def test_a_source_that_dies_mid_handoff_falls_back_to_replay(router, served_model):
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is")[:12]
    source = router.add_worker("a-dying", script=held, role=DECODE)
    target = router.add_worker("b-survivor", script=rest_after_resume(ids, only_replay=True), role=DECODE)
    result = stream_in_background(router)
    start_on(source, ids, 4)
    assert target.wait_for(lambda: target.requests)
    source.stop()  # silent from now on: declared dead before the target had the KV
    result["thread"].join(timeout=20)
    assert result.get("text") == served_model.tokenizer.decode(ids), result
    handoff, replay = target.requests
    assert handoff.kv_source_request_id is not None and replay.kv_source_request_id is None
    assert replay.prefill_endpoint is None and replay.resume_token_ids == ids[:4]
    assert target.cancels == [handoff.request_id]  # the abandoned handoff is stopped there
    assert router.metric('tandem_migrations_total{cause="drain"}') == 0.0  # counted once moved: it never was
    assert router.metric('tandem_migrations_total{cause="worker_died"}') == 1.0
    assert router.metric("tandem_migration_recomputed_tokens_total") > 0


def test_a_handoff_the_target_refuses_goes_back_to_its_source(router, served_model):
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is")[:12]

    def refuse(request):  # it began draining too: refused before it asked for any KV
        return [(0.0, TokenDelta(request_id=request.request_id, finish_reason=FinishCode.ERROR,
                                 error="worker b-refusing is shutting down", retryable=True))]

    source = router.add_worker("a-source", script=held, role=DECODE)
    target = router.add_worker("b-refusing", script=refuse, role=DECODE)
    result = stream_in_background(router)
    wire_id = start_on(source, ids, 4)
    assert source.wait_for(lambda: source.declined == [wire_id])  # the stream is its source's again
    assert target.requests[0].kv_source_request_id == wire_id
    decode_on_in_place(source, wire_id, ids, 4)  # under its id there
    result["thread"].join(timeout=20)
    assert result.get("text") == served_model.tokenizer.decode(ids), result
    assert router.metric('tandem_migrations_total{cause="drain"}') == 0.0
    assert router.metric("tandem_migration_recomputed_tokens_total") == 0.0
    assert router.metric("tandem_handoffs_declined_total") == 1.0
    router.wait_idle()
