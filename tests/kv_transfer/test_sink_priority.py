"""The decode worker's sink asks the prefill worker with the request's priority (its queue order there)."""

from __future__ import annotations

from pipeline.protocol.cluster import GenerateRequest
from tests.kv_transfer.test_connector import GREEDY
from tests.kv_transfer.test_connector_sink import reserve, sink  # noqa: F401 - sink is a fixture


def test_the_prefill_request_carries_the_priority(sink):  # noqa: F811
    sink.expect(GenerateRequest(request_id="g", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=GREEDY,
                                prefill_endpoint="ipc://p", priority=7))
    reserve(sink)
    ((_, request),) = sink.links.sent
    assert request.priority == 7
