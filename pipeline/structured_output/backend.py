"""Grammar backends: compile a ``StructuredOutput`` once, and give each request a matcher.

The interface is what the engine and the router need: ``validate`` (a clear error before any worker
is touched) and ``matcher`` (per request: ``fill_bitmask`` for the next token, ``accept`` a token,
``is_finished``). Two backends implement it:

* ``llguidance`` (default): no compile stall, per-step mask cost flat in vocabulary size; grammars in
  Lark (or its GBNF dialect); unsupported schema keywords are errors;
* ``xgrammar``: grammars compiled ahead (masks precomputed per state); grammars in EBNF/GBNF; it
  ignores schema keywords it does not support (``not``, ``if``/``then``, ...).

Each backend wraps the model's tokenizer once, with the model's vocabulary size, so the padded tail of
the vocabulary is never allowed. Compiled grammars are cached per backend by their constraint. The
bitmask is packed int32 ``[rows, ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` = token t.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.closed_objects import closed_objects
from pipeline.structured_output.xgrammar_schemas import refusal as xgrammar_refusal

if TYPE_CHECKING:  # the router validates constraints too, and never imports torch
    import torch

DEFAULT_BACKEND = "llguidance"
BACKENDS = ("llguidance", "xgrammar")
_CACHE_SIZE = 1024


class StructuredOutputError(ValueError):
    """The constraint cannot be used: a bad schema, regex or grammar, or an unknown backend."""


def _schema_text(spec: StructuredOutput) -> str:
    try:
        schema = json.loads(spec.value)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(f"json_schema: not valid JSON ({exc.msg})") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError("json_schema: must be a JSON object")
    return spec.value


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


def _choice_regex(choices: list[str]) -> str:
    return "|".join(f"({re.escape(choice)})" for choice in choices)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # xgrammar prefixes "[time] file.cc:line: "; keep what a user can act on
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text.splitlines()[0] if text else repr(exc))
    return text


class GrammarBackend:
    """A backend over one model's tokenizer: ``validate`` and ``matcher``; subclasses compile and match."""

    name = ""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def validate(self, spec: StructuredOutput) -> Any:
        """The compiled grammar for ``spec`` (cached); ``StructuredOutputError`` naming the problem otherwise."""
        key = (spec.kind, spec.value, tuple(spec.choices))
        with self._lock:
            compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = self._compile(spec)
            except StructuredOutputError:
                raise
            except Exception as exc:  # noqa: BLE001 - the backend's own errors: a bad schema, regex or grammar
                raise StructuredOutputError(f"{spec.kind}: {_first_line(exc)}") from None
            if self._matches_nothing(compiled):  # else answered "" as a success, or with a token it refuses
                raise StructuredOutputError(f"{spec.kind}: nothing can satisfy it (no output, not even an empty "
                                            f"one, matches)")
            with self._lock:
                if len(self._compiled) >= _CACHE_SIZE:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[key] = compiled
        return compiled

    def matcher(self, spec: StructuredOutput) -> "GrammarMatcher":
        return self._new_matcher(self.validate(spec))

    def _compile(self, spec: StructuredOutput) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _new_matcher(self, compiled: Any) -> "GrammarMatcher":  # pragma: no cover - abstract
        raise NotImplementedError

    def _matches_nothing(self, compiled: Any) -> bool:  # pragma: no cover - abstract
        """Whether no output at all satisfies the compiled grammar (a regex like ``[^\\s\\S]``)."""
        raise NotImplementedError


class GrammarMatcher:
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:  # pragma: no cover - abstract
        """Write the allowed next tokens into ``bitmask[row]``."""
        raise NotImplementedError

    def accept(self, token_id: int) -> bool:  # pragma: no cover - abstract
        """Advance by ``token_id``; False if the grammar does not allow it."""
        raise NotImplementedError

    def try_accept(self, token_id: int) -> bool:  # pragma: no cover - abstract
        """Advance by ``token_id`` if the grammar allows it; otherwise change nothing and return False
        (speculative decoding walks drafts that may break the grammar)."""
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:  # pragma: no cover - abstract
        """Undo the last ``num_tokens`` accepted tokens."""
        raise NotImplementedError

    @property
    def is_finished(self) -> bool:  # pragma: no cover - abstract
        """The grammar is complete and allows nothing more (the request stops here)."""
        raise NotImplementedError

    def allows_only_the_end(self) -> bool:
        """Nothing but the end of the output may follow: asked once, when the request reaches max_tokens (a
        whole answer ends "stop", not "length"). A backend whose matcher finishes only on EOS looks further."""
        return self.is_finished


# ----------------------------------------------------------------- llguidance
class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self._tokenizer = _llguidance_tokenizer(hf_tokenizer, vocab_size)

    def _compile(self, spec: StructuredOutput) -> str:
        import llguidance

        compact = {"whitespace_flexible": False}
        if spec.kind == "json":
            schema = closed_objects(json.loads(_schema_text(spec)))  # as xgrammar reads it: no undeclared keys
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
        elif spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_regex(_choice_regex(spec.choices))
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


# ------------------------------------------------------------------- xgrammar
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
            schema = _schema_text(spec)
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
            return self._compiler.compile_regex(_choice_regex(spec.choices)), False
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
            bit = token_id % 32
            bitmask[0, token_id // 32] &= ~((1 << bit) if bit < 31 else -(1 << 31))  # an int32's bit 31 is its sign
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
    keep = [~blocked[w] & 0xFFFFFFFF for w in words]
    keep = [k - (1 << 32) if k >= 1 << 31 else k for k in keep]  # as int32
    return torch.tensor(words, dtype=torch.long), torch.tensor(keep, dtype=torch.int32)


_BACKEND_CLASSES = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}


def fill_bitmasks(matchers: list[GrammarMatcher], bitmask: "torch.Tensor") -> None:
    """Row ``i`` of ``bitmask`` (packed int32, on the CPU) for ``matchers[i]``, row by row.

    llguidance can also fill a batch on its own thread pool (``fill_next_token_bitmask_par``); on this
    2-core machine that measured slower at batch 64 (4.0 vs 3.2 ms), so one loop it is."""
    for row, matcher in enumerate(matchers):
        if matcher.is_finished:
            # overlap: the request ended on the token just read, and this step's token for it is
            # dropped; a finished matcher has no next mask (xgrammar refuses to compute one)
            bitmask[row] = -1
            continue
        matcher.fill_bitmask(bitmask, row)


def check_backend_name(name: str | None) -> str:
    name = name or DEFAULT_BACKEND
    if name not in BACKENDS:
        raise StructuredOutputError(f"structured_output.backend: unknown backend {name!r} "
                                    f"(available: {', '.join(BACKENDS)})")
    return name


def make_backend(name: str | None, hf_tokenizer, vocab_size: int) -> GrammarBackend:
    """A backend (``name``, default llguidance) over ``hf_tokenizer`` with the model's ``vocab_size``."""
    name = check_backend_name(name)
    try:
        return _BACKEND_CLASSES[name](hf_tokenizer, vocab_size)
    except ImportError:
        raise StructuredOutputError(f"structured_output.backend: {name} is not installed (pip install {name})") from None


class BackendSet:
    """One backend of each kind, built on first use, for one model (the engine's and the router's)."""

    def __init__(self, hf_tokenizer, vocab_size: int, default: str | None = None) -> None:
        self._tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self.default = check_backend_name(default)
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()

    def get(self, name: str | None) -> GrammarBackend:
        name = check_backend_name(name or self.default)
        with self._lock:
            if name not in self._backends:
                self._backends[name] = make_backend(name, self._tokenizer, self._vocab_size)
            return self._backends[name]

    def validate(self, spec: StructuredOutput) -> None:
        self.get(spec.backend).validate(spec)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        return self.get(spec.backend).matcher(spec)
