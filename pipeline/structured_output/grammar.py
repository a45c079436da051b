"""What a grammar backend is: ``GrammarBackend`` compiles a ``StructuredOutput`` once (cached by constraint) and
gives each request a ``GrammarMatcher``; the constraint's shared preparation and ``StructuredOutputError``.

The interface is what the engine and the router need: ``validate`` (a clear error before any worker is touched)
and ``matcher`` (per request: ``fill_bitmask`` for the next token, ``accept`` a token, ``is_finished``). The
backends are ``llguidance_backend`` and ``xgrammar_backend``; ``backend`` picks one. Each wraps the model's
tokenizer once, with the model's vocabulary size, so the padded tail of the vocabulary is never allowed. The
bitmask is packed int32 ``[rows, ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` = token t.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any

from pipeline.protocol import StructuredOutput

if TYPE_CHECKING:  # the router validates constraints too, and never imports torch
    import torch

_CACHE_SIZE = 1024


class StructuredOutputError(ValueError):
    """The constraint cannot be used: a bad schema, regex or grammar, or an unknown backend."""


def schema_text(spec: StructuredOutput) -> str:
    """A json constraint's schema text, checked to be a JSON object (or boolean schema)."""
    try:
        schema = json.loads(spec.value)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(f"json_schema: not valid JSON ({exc.msg})") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError("json_schema: must be a JSON object")
    return spec.value


def choice_regex(choices: list[str]) -> str:
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
