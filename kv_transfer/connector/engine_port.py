"""What the connector halves need from a worker's engine, and nothing more (``LLMEngine.kv``, a
``pipeline.kv_port.KVPort``, provides it; tests pass fakes). ``kv_transfer`` never imports the engine: workers hand it in."""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class SourceEngine(Protocol):
    """The sending side's view: where a request's KV lies, and ending a request when its blocks may go."""

    @property
    def page_size(self) -> int: ...

    def block_table(self, request_id: str) -> list[int]: ...

    def abort_request(self, request_id: str, keep_blocks: bool = False) -> bool:
        """End the request and free its blocks (``keep_blocks``: hold them until a later abort frees them)."""


class Reservation(Protocol):
    """A request the engine reserved blocks for, whose KV another worker sends."""

    request_id: str
    token_ids: Sequence[int]  # prompt, and a migrated stream's tokens so far
    num_cached_tokens: int  # leading tokens whose KV this worker already holds (its prefix cache)


class SinkEngine(Protocol):
    """The receiving side's view: reserve blocks, activate a request whose KV landed, or end it."""

    def reserve_remote(self) -> Sequence[Reservation]: ...

    def block_table(self, request_id: str) -> list[int]: ...

    def withhold_from_prefix_cache(self, request_id: str) -> None:
        """The request's blocks will not all hold valid KV (a sliding-window layer's blocks outside its window
        are not sent): none of them may enter the prefix cache."""

    def activate_remote(self, request_id: str, first_token_id: int, first_logprobs: dict[int, float] | None,
                        prompt_logprobs: Any = None, num_prefill_computed_tokens: int | None = None) -> Any:
        """The prompt's KV landed: the request decodes from its first token (returns its step output);
        ``num_prefill_computed_tokens``: what the prefill worker ran of the prompt (the rest counts as cached)."""

    def activate_migrated(self, request_id: str, num_draft_computed_tokens: int | None = None) -> None:
        """A migrated stream's KV landed: it decodes on, emitting nothing now."""

    def abort_request(self, request_id: str, keep_blocks: bool = False) -> bool: ...
