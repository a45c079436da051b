"""Stop checks and detokenization after each sampled token (EOS, stop ids, stop strings, lengths)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.protocol import FinishReason
from pipeline.sequence import Sequence
from pipeline.stop_strings import StopStringMatcher
from pipeline.tokenizer import IncrementalDetokenizer


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._text: dict[str, _TextState] = {}

    def add(self, seq: Sequence) -> None:
        if seq.params.stop:  # only stop strings need text while running; others decode once at the end
            self._text[seq.request_id] = _TextState(
                IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens),
                StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output),
            )
            if seq.num_output_tokens:  # a resumed request: a stop string may span the earlier tokens
                self._text[seq.request_id].detokenizer.add(list(seq.output_token_ids))

    def check_stop(self, seq: Sequence, token_id: int,
                   num_tokens: int | None = None) -> tuple[str, str | int | None] | None:
        """After ``token_id`` was appended to ``seq``: (finish_reason, stop_reason) if it must end now.

        ``num_tokens``: the sequence's length up to and including ``token_id`` (default: its length now;
        the overlap pipeline checks a token one step late, when a placeholder may already follow it)."""
        params = seq.params
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP.value, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP.value, token_id
        state = self._text.get(seq.request_id)
        if state is not None:
            delta = state.detokenizer.add([token_id])
            if num_output > params.min_tokens:  # as vLLM: a stop string ends only what has min_tokens before it
                match = state.matcher.find(state.detokenizer.text, len(delta))
                if match is not None:
                    seq.text = match[0]
                    return FinishReason.STOP.value, match[1]
        if num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH.value, None
        return None

    def finalize_text(self, seq: Sequence, ended_by_stop_token: bool = False) -> None:
        """Set ``seq.text`` for a finished sequence (already set when a stop string ended it). A stop token's
        text (an EOS, one of ``stop_token_ids``) is left out unless ``include_stop_str_in_output``, as vLLM's
        detokenizer does (the token itself stays among the output tokens)."""
        state = self._text.pop(seq.request_id, None)
        if seq.stop_reason is not None and isinstance(seq.stop_reason, str):
            return
        token_ids = list(seq.output_token_ids)
        if ended_by_stop_token and not seq.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        elif state is not None and not ended_by_stop_token:  # its detokenizer has read every token
            state.detokenizer.finish()
            seq.text = state.detokenizer.text
            return
        seq.text = self.tokenizer.decode(token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def drop(self, request_id: str) -> None:
        self._text.pop(request_id, None)
