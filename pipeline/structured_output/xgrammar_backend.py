"""The ``xgrammar`` grammar backend: grammars compiled ahead (token masks precomputed per state); grammars in
EBNF/GBNF; schema keywords it would ignore (``not``, ``if``/``then``, ...) are refused first
(``xgrammar_schemas``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.grammar import (GrammarBackend, GrammarMatcher, StructuredOutputError, choice_regex,
                                                schema_text)
from pipeline.structured_output.xgrammar_schemas import refusal as xgrammar_refusal

if TYPE_CHECKING:
    import torch


class XGrammarBackend(GrammarBackend):
    """xgrammar: grammars compiled ahead of use (token masks precomputed per state); EBNF/GBNF grammars.

    JSON constraints are compact (no whitespace between tokens, as llguidance's). xgrammar's JSON
    strings accept some raw control characters (0x01-0x1f other than tab and newline) that strict JSON
    forbids; in compact JSON no such character may appear outside a string either, so for JSON
    constraints every token holding one is masked out as well."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar

        super().__init__(vocab_size)
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info)
        self._control_tokens = _control_character_tokens(hf_tokenizer, vocab_size)

    def _compile(self, spec: StructuredOutput) -> Any:
        compact = {"any_whitespace": False, "separators": (",", ":")}  # as llguidance: compact JSON
        if spec.kind == "json":
            schema = schema_text(spec)
            why = xgrammar_refusal(json.loads(schema))
            if why:
                raise StructuredOutputError(why)
            return self._compiler.compile_json_schema(schema, **compact), True
        if spec.kind == "json_object":
            # an object, any keys: its strict mode would allow only "{}", its compact mode no nested values, its
            # built-in JSON grammar arrays too; one whitespace between tokens at most
            return self._compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                      max_whitespace_cnt=1), True
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.value), False
        if spec.kind == "choice":
            return self._compiler.compile_regex(choice_regex(spec.choices)), False
        return self._compiler.compile_grammar(spec.value), False

    def _new_matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar

        grammar, is_json = compiled
        return _XGrammarMatcher(xgrammar.GrammarMatcher(grammar), self._control_tokens if is_json else None,
                                self.vocab_size)

    def _matches_nothing(self, compiled: Any) -> bool:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled[0]).fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())  # not even the end of the output is allowed


class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher, blocked_tokens, vocab_size: int) -> None:
        self._matcher = matcher
        self._blocked = blocked_tokens  # token ids never allowed (JSON: raw control characters), or None
        self._vocab_size = vocab_size

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._blocked is not None:
            words, bits = self._blocked
            bitmask[row, words] &= bits

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def try_accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))  # a refused token leaves the state as it was

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_terminated())

    def allows_only_the_end(self) -> bool:
        """xgrammar terminates only on a stop token: complete here, with nothing but stop tokens allowed next."""
        import xgrammar

        if self.is_finished:
            return True
        if not self._matcher.is_completed():
            return False
        bitmask = xgrammar.allocate_token_bitmask(1, self._vocab_size)  # [1, words] int32
        self.fill_bitmask(bitmask, 0)
        for token_id in self._matcher.stop_token_ids:
            bitmask[0, token_id // 32] &= _as_int32(~(1 << (token_id % 32)) & 0xFFFFFFFF)
        return not bool(bitmask.any())


def _control_character_tokens(hf_tokenizer, vocab_size: int):
    """(word indices, AND masks) clearing the bits of tokens whose text holds a character below 0x20."""
    import torch

    blocked: dict[int, int] = {}
    for token_id in range(min(vocab_size, len(hf_tokenizer))):
        text = hf_tokenizer.decode([token_id], skip_special_tokens=True)
        if any(ord(ch) < 0x20 for ch in text):
            blocked[token_id // 32] = blocked.get(token_id // 32, 0) | (1 << (token_id % 32))
    words = sorted(blocked)
    keep = [_as_int32(~blocked[w] & 0xFFFFFFFF) for w in words]
    return torch.tensor(words, dtype=torch.long), torch.tensor(keep, dtype=torch.int32)


def _as_int32(word: int) -> int:
    """A 32-bit mask word (0 .. 2**32 - 1) as the signed int32 a bitmask holds: bit 31 is the sign."""
    return word - (1 << 32) if word >= 1 << 31 else word
