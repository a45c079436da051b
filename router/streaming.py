"""Token deltas -> OpenAI text: incremental detokenization, stop strings, logprobs, usage.

One ``OutputBuilder`` per prompt turns each ``TokenDelta`` into a ``Piece`` (new text, logprob
entries, finish reason; with the first delta, what the response shows of the prompt: echoed text and
its logprobs, vLLM's ``prompt_logprobs``). While stop strings are set, the last ``len(longest stop) - 1`` characters are
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
from pipeline.protocol.requests import PromptLogprobs, SamplingParams, TokenLogprob
from pipeline.stop_strings import StopStringMatcher
from pipeline.tokenizer import IncrementalDetokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class LogprobEntry:
    token: str
    logprob: float | None  # None: the prompt's first token (nothing before it to predict it)
    top: list[tuple[str, float]] | None  # top-N (token text, logprob); the sampled token is not repeated here
    text_offset: int
    # chat's ``bytes`` of a token that ends inside a character, and of such top ones (None: the text's UTF-8)
    token_bytes: list[int] | None = None
    top_bytes: list[list[int] | None] | None = None  # None: every top token is whole characters


@dataclass
class PromptRendering:
    """What a response shows of its prompt. ``echo_text`` (completions ``echo``): the prompt's text
    before the completion, with its tokens' logprobs first when ``num_top_echo`` is set (top N each);
    ``num_top_prompt_logprobs``: vLLM's ``prompt_logprobs`` field; ``discard_output``: ``max_tokens`` 0
    with echo (the one token the worker samples is not shown or counted)."""

    token_ids: list[int] = field(default_factory=list)
    echo_text: str | None = None
    num_top_echo: int | None = None
    num_top_prompt_logprobs: int | None = None
    discard_output: bool = False


@dataclass
class Piece:
    text: str = ""  # with echo, the first piece's text starts with the prompt's
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's shape, with the first piece
    finish_reason: str | None = None  # "stop" | "length" | None; errors surface as ``error``
    stop_reason: str | int | None = None
    error: str | None = None
    matched_stop_string: bool = False  # the router ended it: the worker must be told to stop


class OutputBuilder:
    def __init__(self, model, params: SamplingParams, num_prompt_tokens: int,
                 prompt: PromptRendering | None = None, tokens_as_ids: bool = False) -> None:
        self._model = model
        self._tokens_as_ids = tokens_as_ids
        self._params = params
        self._prompt = prompt or PromptRendering()
        self._echo_pending = self._prompt.echo_text is not None
        self._text_base = len(self._prompt.echo_text or "")  # offsets of generated tokens start after the echo
        self._detok = IncrementalDetokenizer(model.tokenizer, skip_special_tokens=params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._holdback = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.cumulative_logprob = 0.0  # of every generated token (best_of ranks candidates by it)
        self.finish_reason: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: TokenDelta) -> Piece:
        piece = Piece()
        if self.is_finished:
            return piece
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        echo = self._render_prompt(delta, piece)
        for entry in delta.logprobs or ():
            if entry:
                self.cumulative_logprob += entry[0].logprob
        if self._prompt.discard_output:
            return self._prefixed(echo, self._discard(delta, piece))
        num_tokens = len(delta.token_ids)
        for i, token_id in enumerate(delta.token_ids):
            self.num_output_tokens += 1
            is_stop_token = (
                i == num_tokens - 1 and delta.stop_token_id is not None and token_id == delta.stop_token_id
            )
            offset = len(self.text)
            if self._params.logprobs is not None and delta.logprobs is not None and i < len(delta.logprobs):
                # the stop token (EOS, stop_token_ids) too, as vLLM lists it: one entry per completion token,
                # though its text is not part of the answer
                piece.logprobs.append(self._entry(delta.logprobs[i], token_id, self._text_base + offset))
            if is_stop_token and not self._params.include_stop_str_in_output:  # its text is not the answer's
                break
            new_text = self._detok.add([token_id])
            if self._append(new_text, piece):
                return self._prefixed(echo, self._emit(piece))
        if delta.finish_reason is not None:
            code = FinishCode(delta.finish_reason)
            if code in (FinishCode.STOP, FinishCode.LENGTH):
                if self._append(self._detok.finish(), piece):
                    return self._prefixed(echo, self._emit(piece))
                self.finish_reason = piece.finish_reason = code.to_finish_reason().value
                piece.stop_reason = None if delta.is_eos else delta.stop_token_id
            else:
                self._fail(delta, code, piece)
        return self._prefixed(echo, self._emit(piece))

    def _fail(self, delta: TokenDelta, code: FinishCode, piece: Piece) -> None:
        self.finish_reason = "error"
        piece.error = delta.error or ("the request was aborted" if code == FinishCode.ABORT else "generation failed")

    def _discard(self, delta: TokenDelta, piece: Piece) -> Piece:
        """``max_tokens`` 0: the prompt alone; the worker's one token is neither shown nor counted."""
        if delta.finish_reason is not None:
            code = FinishCode(delta.finish_reason)
            if code in (FinishCode.STOP, FinishCode.LENGTH):
                self.finish_reason = piece.finish_reason = "length"
            else:
                self._fail(delta, code, piece)
        return piece

    # ------------------------------------------------------------------ the prompt
    def _render_prompt(self, delta: TokenDelta, piece: Piece) -> tuple[str, list[LogprobEntry]] | None:
        """With the first delta that carries tokens: vLLM's prompt_logprobs on ``piece``, and the echo
        (text, entries) to put before the completion's own."""
        prompt = self._prompt
        if not delta.token_ids and delta.finish_reason is None:
            return None
        scored = delta.prompt_logprobs
        if prompt.num_top_prompt_logprobs is not None and piece.prompt_logprobs is None and scored is not None:
            piece.prompt_logprobs = self._vllm_prompt_logprobs(scored, prompt.num_top_prompt_logprobs)
        if not self._echo_pending:
            return None
        self._echo_pending = False
        entries: list[LogprobEntry] = []
        if prompt.num_top_echo is not None and scored is not None and len(scored) == len(prompt.token_ids) - 1:
            # each token's offset is where its text starts in the prompt's: the length decoded before it (a token
            # that ends inside a character adds nothing yet, so the tokens of one character share its offset)
            detok = IncrementalDetokenizer(self._model.tokenizer, skip_special_tokens=self._params.skip_special_tokens)
            for position, token_id in enumerate(prompt.token_ids):
                text, offset = self._token_label(token_id), len(detok.text)
                detok.add([token_id])
                if position == 0:
                    entries.append(LogprobEntry(text, None, None, offset))
                else:
                    top = [(self._token_label(lp.token_id), _clean(lp.logprob))
                           for lp in scored.top[position - 1][:prompt.num_top_echo]]
                    entries.append(LogprobEntry(text, _clean(scored.logprobs[position - 1]), top, offset))
        return prompt.echo_text, entries

    def _vllm_prompt_logprobs(self, scored: PromptLogprobs, num_top: int) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = [None]
        for i, token_id in enumerate(self._prompt.token_ids[1:len(scored) + 1]):
            entry = {str(token_id): {"logprob": _clean(scored.logprobs[i]), "rank": scored.ranks[i],
                                     "decoded_token": self._model.token_text(token_id)}}
            for rank, lp in enumerate(scored.top[i][:num_top], start=1):
                entry.setdefault(str(lp.token_id), {"logprob": _clean(lp.logprob), "rank": rank,
                                                    "decoded_token": self._model.token_text(lp.token_id)})
            out.append(entry)
        return out

    @staticmethod
    def _prefixed(echo: tuple[str, list[LogprobEntry]] | None, piece: Piece) -> Piece:
        if echo is not None:
            piece.text = echo[0] + piece.text
            piece.logprobs = echo[1] + piece.logprobs
        return piece

    def _append(self, new_text: str, piece: Piece) -> bool:
        """Add text; True when a stop string matched (text truncated, request finished)."""
        if not new_text:
            return False
        self.text += new_text
        if self.num_output_tokens <= self._params.min_tokens:  # the worker's rule: no stop string before that
            return False
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
        top = [(self._token_label(lp.token_id), _clean(lp.logprob)) for lp in logprobs[1:]]
        entry = LogprobEntry(self._token_label(token_id), _clean(sampled.logprob), top, offset)
        if not self._tokens_as_ids:  # (labels that are ids have their own bytes)
            entry.token_bytes = self._model.partial_token_bytes(token_id)
            top_bytes = [self._model.partial_token_bytes(lp.token_id) for lp in logprobs[1:]]
            entry.top_bytes = top_bytes if any(b is not None for b in top_bytes) else None
        return entry

    def _token_label(self, token_id: int) -> str:
        """How a logprob entry names its token: its text, or vLLM's "token_id:N" (``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if self._tokens_as_ids else self._model.token_text(token_id)

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


def completion_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    top_logprobs: list[dict[str, float] | None] = []
    for e in entries:
        if e.top is None:  # the prompt's first token
            top_logprobs.append(None)
            continue
        top = {e.token: e.logprob}
        top.update({text: lp for text, lp in e.top if text not in top})
        top_logprobs.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top_logprobs,
        "text_offset": [e.text_offset for e in entries],
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    def item(text: str, logprob: float, raw: list[int] | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")) if raw is None else raw}

    def top(e: LogprobEntry) -> list[dict[str, Any]]:
        raws = e.top_bytes or [None] * len(e.top or [])
        return [item(text, lp, raw) for (text, lp), raw in zip(e.top or [], raws)]

    return {"content": [{**item(e.token, e.logprob, e.token_bytes), "top_logprobs": top(e)} for e in entries]}


@dataclass
class ChoiceResult:
    """One finished choice of a non-streaming response."""

    index: int
    text: str
    entries: list[LogprobEntry]
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    message: dict[str, Any] | None = None  # chat: content, reasoning_content, tool_calls (None: the text is the content)


@dataclass
class ResponseShape:
    """Ids and names shared by every chunk of one response."""

    kind: str  # "completion" | "chat"
    response_id: str
    model_name: str
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def _object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def chunk(self, piece: Piece, first: bool = False, index: int = 0,
              fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streamed chunk; ``fields``: a chat delta's fields when a parser made them (None: the text is content)."""
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": piece.text, "logprobs": None,
                                      "finish_reason": piece.finish_reason}
            if self.want_logprobs:
                choice["logprobs"] = completion_logprobs(piece.logprobs)
        else:
            delta: dict[str, Any] = {"role": "assistant", "content": piece.text} if first else {}
            if fields is not None and not first:
                delta.update(fields)
            elif piece.text and not first:
                delta["content"] = piece.text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}
            if self.want_logprobs and piece.logprobs:
                choice["logprobs"] = chat_logprobs(piece.logprobs)
        if piece.finish_reason is not None:
            choice["stop_reason"] = piece.stop_reason
        return {"id": self.response_id, "object": self._object, "created": self.created, "model": self.model_name,
                "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.response_id, "object": self._object, "created": self.created, "model": self.model_name,
                "choices": [], "usage": usage}

    def full(self, choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        body_choices = []
        for result in choices:
            if self.kind == "completion":
                choice: dict[str, Any] = {"index": result.index, "text": result.text, "logprobs": None}
                if self.want_logprobs:
                    choice["logprobs"] = completion_logprobs(result.entries)
                if result.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = result.prompt_logprobs  # vLLM: per choice on completions
            else:
                message = result.message if result.message is not None else {"content": result.text}
                choice = {"index": result.index, "message": {"role": "assistant", **message}, "logprobs": None}
                if self.want_logprobs:
                    choice["logprobs"] = chat_logprobs(result.entries)
            choice["finish_reason"] = result.finish_reason
            choice["stop_reason"] = result.stop_reason
            body_choices.append(choice)
        body = {"id": self.response_id, "object": self._object.removesuffix(".chunk"), "created": self.created,
                "model": self.model_name, "choices": body_choices, "usage": usage}
        if self.kind == "chat" and choices and choices[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = choices[0].prompt_logprobs  # vLLM: top level on chat
        return body


def total_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of a response with several prompts: every count summed."""
    if len(usages) == 1:
        return usages[0]
    total: dict[str, Any] = {key: sum(u[key] for u in usages)
                             for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": cached}
    return total
