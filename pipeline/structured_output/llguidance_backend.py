"""The ``llguidance`` grammar backend (the default): no compile stall, a per-step mask cost flat in vocabulary
size; grammars in Lark (or its GBNF dialect); schema keywords it does not support are errors."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.closed_objects import closed_objects
from pipeline.structured_output.grammar import (GrammarBackend, GrammarMatcher, StructuredOutputError, choice_regex,
                                                schema_text)

if TYPE_CHECKING:
    import torch

_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def _as_lark(grammar: str) -> str:
    """A GBNF grammar (llama.cpp's, vLLM's examples: ``root ::= ...``) in llguidance's Lark; Lark as it is."""
    if not _GBNF_RULE.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - the translator's own errors name the bad rule
        raise StructuredOutputError(f"grammar: {str(exc).strip() or exc!r}") from None



class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self._tokenizer = _llguidance_tokenizer(hf_tokenizer, vocab_size)

    def _compile(self, spec: StructuredOutput) -> str:
        import llguidance

        compact = {"whitespace_flexible": False}
        if spec.kind == "json":
            schema = closed_objects(json.loads(schema_text(spec)))  # as xgrammar reads it: no undeclared keys
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
        elif spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_regex(choice_regex(spec.choices))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(_as_lark(spec.value))
        message = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if message:
            raise StructuredOutputError(f"{spec.kind}: {message.strip().splitlines()[0]}")
        return grammar

    def _new_matcher(self, grammar: str) -> GrammarMatcher:
        import llguidance

        return _LLGuidanceMatcher(llguidance.LLMatcher(self._tokenizer, grammar))

    def _matches_nothing(self, grammar: str) -> bool:
        import llguidance

        fresh = llguidance.LLMatcher(self._tokenizer, grammar)
        fresh.compute_bitmask()  # a dead grammar stops here, unaccepting (its mask then allows only the EOS)
        return fresh.is_error() or (fresh.is_stopped() and not fresh.is_accepting())


class _TextTokens:
    """What llguidance's ``TokenizerWrapper`` reads: every token's bytes, which ids are special, and how
    text tokenizes. Special means the checkpoint's special tokens only, and text never tokenizes into
    them (``split_special_tokens``); an added token that is not special (Qwen's ``<tool_call>``,
    ``<think>``) is the text it spells, as in xgrammar.

    llguidance's own loader makes every added token special, yet tokenizes forced text into them: a
    grammar forcing "x<tool_call>y" allowed ``<tool_call>`` by the mask, which the matcher then refused.
    """

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance.hf

        loaded = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)  # byte decoding of every format
        num_tokens = min(len(hf_tokenizer), vocab_size)
        self.tokens = [loaded.decode_bytes([i]) for i in range(num_tokens)]
        added = getattr(hf_tokenizer, "added_tokens_decoder", {})
        special = set(hf_tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
        self.special_token_ids = sorted(i for i in special if i < num_tokens)
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self._hf = hf_tokenizer

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):  # llguidance probes whether bytes are taken: they are not
            raise TypeError("text only")
        return self._hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _llguidance_tokenizer(hf_tokenizer, vocab_size: int):
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(_TextTokens(hf_tokenizer, vocab_size)), n_vocab=vocab_size)


class _LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    def try_accept(self, token_id: int) -> bool:
        return self._matcher.try_consume_tokens([token_id]) == 1  # consume_token would enter an error state

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())
