"""The model the router serves: its name, tokenizer, vocabulary size and length limit (no weights, no torch)."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.checkpoint_files import max_positions
from pipeline.generation_config import read_generation_config
from pipeline.protocol.cluster import served_model_name, served_names as served_names_of
from pipeline.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def keep_torch_out() -> bool:
    """Make this process treat torch as not installed; True when the guard is in place.

    transformers imports torch whenever it is installed, even just to load a tokenizer (its config
    module does) or to decode (tensor type checks). A ``None`` entry in ``sys.modules`` makes
    ``importlib.util.find_spec("torch")`` answer "absent", so transformers stays on its torch-free path.
    Only for a process that is the router alone (``run_router`` calls it first): it does nothing once
    torch or transformers is already imported, e.g. in tests or a launcher that also runs workers.
    """
    if sys.modules.get("torch", 0) is None:
        return True
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" notice
    return True


@dataclass
class ServedModel:
    name: str
    tokenizer: Any
    vocab_size: int
    max_length: int | None  # prompt + output tokens; None: only the workers' limits apply
    root: str | None = None  # the checkpoint directory (vLLM's "root" in /v1/models: where clients find the tokenizer)
    aliases: tuple[str, ...] = ()  # further names clients may ask for (model.served_model_name)
    generation_config: dict[str, Any] = field(default_factory=dict)  # the checkpoint's generation_config.json
    checkpoint_name: str = ""  # what workers register with: the checkpoint folder's name (default: ``name``)

    def __post_init__(self) -> None:
        self.checkpoint_name = self.checkpoint_name or self.name

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def serves(self, requested: str) -> bool:
        return requested == self.name or requested in self.aliases
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)

    def partial_token_bytes(self, token_id: int) -> list[int] | None:
        """The bytes of a token that ends inside a character (its text is U+FFFD, whose UTF-8 says nothing), for
        logprobs' ``bytes`` (``router/token_bytes.py``); None for a token of whole characters, whose bytes are its
        text's UTF-8 (nearly every token: one substring test, from the cached text)."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return None
        from router.token_bytes import token_bytes

        return list(token_bytes(self.tokenizer, token_id, text))

    def token_text(self, token_id: int) -> str:
        """A single token rendered as text (logprobs); cached because the same ids recur constantly."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text


def load_served_model(
    model_path: str | None,
    max_length: int | None = None,
    name: str | None = None,
    tokenizer: Any | None = None,
    served_names: str | None = None,
) -> ServedModel:
    """Read the tokenizer and ``config.json`` of a checkpoint directory.

    ``model_path`` None means the built-in model: its directory must already exist (the deploy layer
    builds it for the workers; building needs torch, which the router never imports).
    ``max_length`` None takes the checkpoint's ``max_position_embeddings``. ``name``: the name workers
    register with (default: the checkpoint folder's); ``served_names``: the names clients ask for,
    comma-separated (``model.served_model_name``; default: that same name).
    """
    checkpoint_name = name or served_model_name(model_path)
    names = served_names_of(served_names, checkpoint_name)
    path = Path(model_path) if model_path else _builtin_path()
    hf_config = _read_json(path / "config.json")
    text_config = hf_config.get("text_config") or {}
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    vocab_size = int(hf_config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer))
    if max_length is None:
        max_length = max_positions(hf_config)
    return ServedModel(names[0], tokenizer, vocab_size, int(max_length) if max_length else None,
                       root=str(path.resolve()), aliases=tuple(names[1:]), checkpoint_name=checkpoint_name,
                       generation_config=read_generation_config(path))


def _builtin_path() -> Path:
    from pipeline.builtin_model import builtin_model_path  # torch-free unless it has to build; checked first

    home = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
    if not any(home.glob("builtin-*-v*/config.json")):  # building it would import torch: refuse
        raise FileNotFoundError(
            f"the built-in model is not built yet under {home}; start a worker first "
            "(it builds it) or pass the checkpoint directory as model_path"
        )
    return builtin_model_path()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        logger.warning("no %s: vocabulary size comes from the tokenizer, max_length from the workers", path)
        return {}
