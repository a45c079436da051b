"""Which grammar backend serves a constraint: ``make_backend`` / ``BackendSet`` by name, and ``fill_bitmasks`` for a
step's rows. Two backends (``grammar`` says what one is):

* ``llguidance`` (default, ``llguidance_backend``): no compile stall, per-step mask cost flat in vocabulary size;
  grammars in Lark (or its GBNF dialect); unsupported schema keywords are errors;
* ``xgrammar`` (``xgrammar_backend``): grammars compiled ahead (masks precomputed per state); grammars in
  EBNF/GBNF; it ignores schema keywords it does not support (``not``, ``if``/``then``, ...), which are refused
  first.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.grammar import GrammarBackend, GrammarMatcher, StructuredOutputError
from pipeline.structured_output.llguidance_backend import LLGuidanceBackend
from pipeline.structured_output.xgrammar_backend import XGrammarBackend

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BackendSet", "GrammarBackend", "GrammarMatcher", "LLGuidanceBackend",
           "StructuredOutputError", "XGrammarBackend", "check_backend_name", "fill_bitmasks", "make_backend"]

DEFAULT_BACKEND = "llguidance"
BACKENDS = ("llguidance", "xgrammar")

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
        raise StructuredOutputError(
            f"structured_output.backend: {name} is not installed (pip install {name})") from None


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
