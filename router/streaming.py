"""Token deltas -> OpenAI text: incremental detokenization, stop strings, logprobs, usage.

One ``OutputBuilder`` per request turns each ``TokenDelta`` into a ``Piece`` (new text, logprob
entries, finish reason). While stop strings are set, the last ``len(longest stop) - 1`` characters are
held back until it is clear they do not begin a stop string, so a client never sees text that is later
cut. A final stop token (EOS or a stop token id) counts in usage but is not rendered. The ``format_*``
functions build the completions and chat JSON shapes from pieces.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.protocol.cluster import FinishCode, TokenDelta
from pipeline.protocol.requests import SamplingParams, TokenLogprob
from pipeline.stop_strings import StopStringMatcher
from pipeline.tokenizer import IncrementalDetokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class LogprobEntry:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # top-N (token text, logprob); the sampled token is not repeated here
    text_offset: int


@dataclass
class Piece:
    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | None; errors surface as ``error``
    stop_reason: str | int | None = None
    error: str | None = None
    matched_stop_string: bool = False  # the router ended it: the worker must be told to stop


class OutputBuilder:
    def __init__(self, model, params: SamplingParams, num_prompt_tokens: int) -> None:
        self._model = model
        self._params = params
        self._detok = IncrementalDetokenizer(model.tokenizer, skip_special_tokens=params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._holdback = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: TokenDelta) -> Piece:
        piece = Piece()
        if self.is_finished:
            return piece
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        num_tokens = len(delta.token_ids)
        for i, token_id in enumerate(delta.token_ids):
            self.num_output_tokens += 1
            is_stop_token = (
                i == num_tokens - 1 and delta.stop_token_id is not None and token_id == delta.stop_token_id
            )
            if is_stop_token:
                break
            offset = len(self.text)
            new_text = self._detok.add([token_id])
            if self._params.logprobs is not None and delta.logprobs is not None and i < len(delta.logprobs):
                piece.logprobs.append(self._entry(delta.logprobs[i], token_id, offset))
            if self._append(new_text, piece):
                return self._emit(piece)
        if delta.finish_reason is not None:
            code = FinishCode(delta.finish_reason)
            if code in (FinishCode.STOP, FinishCode.LENGTH):
                if self._append(self._detok.finish(), piece):
                    return self._emit(piece)
                self.finish_reason = piece.finish_reason = code.to_finish_reason().value
                piece.stop_reason = delta.stop_token_id
            else:
                self.finish_reason = "error"
                piece.error = delta.error or ("the request was aborted" if code == FinishCode.ABORT else "generation failed")
        return self._emit(piece)

    def _append(self, new_text: str, piece: Piece) -> bool:
        """Add text; True when a stop string matched (text truncated, request finished)."""
        if not new_text:
            return False
        self.text += new_text
        match = self._stops.find(self.text, len(new_text))
        if match is None:
            return False
        self.text, stop = match
        self.finish_reason = piece.finish_reason = "stop"
        piece.stop_reason = stop
        piece.matched_stop_string = True
        return True

    def _emit(self, piece: Piece) -> Piece:
        visible = len(self.text) if self.is_finished else max(self.num_emitted_chars, len(self.text) - self._holdback)
        piece.text = self.text[self.num_emitted_chars:visible]
        self.num_emitted_chars = visible
        return piece

    def _entry(self, logprobs: list[TokenLogprob], token_id: int, offset: int) -> LogprobEntry:
        sampled = logprobs[0] if logprobs else TokenLogprob(token_id, float("nan"))
        top = [(self._model.token_text(lp.token_id), _clean(lp.logprob)) for lp in logprobs[1:]]
        return LogprobEntry(self._model.token_text(token_id), _clean(sampled.logprob), top, offset)

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
        }
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage


def _clean(logprob: float) -> float:
    return MIN_LOGPROB if not math.isfinite(logprob) else max(MIN_LOGPROB, float(logprob))


# ---------------------------------------------------------------------------- JSON shapes


def completion_logprobs(entries: list[LogprobEntry], base_offset: int = 0) -> dict[str, Any]:
    top_logprobs = []
    for e in entries:
        top = {e.token: e.logprob}
        top.update({text: lp for text, lp in e.top if text not in top})
        top_logprobs.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top_logprobs,
        "text_offset": [base_offset + e.text_offset for e in entries],
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(text, lp) for text, lp in e.top]} for e in entries
        ]
    }


@dataclass
class ResponseShape:
    """Ids and names shared by every chunk of one response."""

    kind: str  # "completion" | "chat"
    response_id: str
    model_name: str
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, piece: Piece, first: bool = False) -> dict[str, Any]:
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason}
            if self.want_logprobs:
                choice["logprobs"] = completion_logprobs(piece.logprobs)
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant", "content": piece.text} if first else {}
            if piece.text and not first:
                delta["content"] = piece.text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}
            if self.want_logprobs and piece.logprobs:
                choice["logprobs"] = chat_logprobs(piece.logprobs)
            obj = "chat.completion.chunk"
        if piece.finish_reason is not None:
            choice["stop_reason"] = piece.stop_reason
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model_name,
                "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model_name,
                "choices": [], "usage": usage}

    def full(self, text: str, entries: list[LogprobEntry], finish_reason: str | None, stop_reason,
             usage: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
            if self.want_logprobs:
                choice["logprobs"] = completion_logprobs(entries)
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            if self.want_logprobs:
                choice["logprobs"] = chat_logprobs(entries)
            obj = "chat.completion"
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = stop_reason
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model_name,
                "choices": [choice], "usage": usage}
