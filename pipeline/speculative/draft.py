"""The draft model of speculative decoding: loaded beside the target, checked against it, and where
its KV lives (in the target's cache tensor, as extra layers, whenever the KV layout per layer matches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.checkpoint_errors import CheckpointError
from pipeline.config import ConfigError, PipelineRole
from pipeline.speculative.draft_context import check_draft_covers
from pipeline.tokenizer import load_tokenizer
from pipeline.weights import checkpoint_fingerprint, load_model


@dataclass
class DraftModel:
    model: torch.nn.Module
    hf_config: object
    model_path: str
    is_target: bool  # no draft checkpoint given: the target drafts for itself (every draft is accepted)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def fingerprint(self) -> str:
        return "self" if self.is_target else checkpoint_fingerprint(self.model_path)


def load_draft_model(draft_path: str | None, target_path: str, target_model: torch.nn.Module, target_hf_config,
                     target_tokenizer, dtype: torch.dtype, device: str, max_length: int) -> DraftModel:
    """The draft at ``draft_path`` (None: the target itself, sharing its weights), or a CheckpointError
    naming the draft when it cannot be loaded or does not share the target's tokenizer, or a ConfigError when
    it does not cover the ``max_length`` positions the target serves."""
    if draft_path is None:
        return DraftModel(target_model, target_hf_config, target_path, is_target=True)
    try:
        model, hf_config = load_model(draft_path, dtype, device)
        tokenizer = load_tokenizer(draft_path)
    except CheckpointError as exc:
        raise CheckpointError(f"draft_model.model_path: {exc}") from None
    check_same_tokenizer(tokenizer, target_tokenizer, draft_path)
    check_draft_covers(draft_path, getattr(hf_config, "max_position_embeddings", None), max_length)
    return DraftModel(model, hf_config, draft_path, is_target=False)


def check_same_tokenizer(draft_tokenizer, target_tokenizer, draft_path: str) -> None:
    """The draft proposes token ids the target checks: both must mean the same text by the same id."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for token, i in draft_vocab.items() if target_vocab.get(token) != i)
        differing += sum(1 for token in target_vocab if token not in draft_vocab)
        raise CheckpointError(
            f"draft_model.model_path: {draft_path} does not share the target's tokenizer ({len(draft_vocab)} vs "
            f"{len(target_vocab)} tokens, {differing} differ); a draft must use the same vocabulary")


def allocate_kv_caches(shape: tuple[int, ...], draft_shape: tuple[int, ...], allocate: Callable,
                       role: PipelineRole, is_target_split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache, the draft's cache), each ``[layers, 2, blocks, page, kv_heads, head_dim]``.

    A draft with the target's KV layout per layer gets extra layers of the one tensor ``allocate``
    makes (the draft's cache is a view of them), so its KV is shipped, checksummed and placed in shared
    memory with the target's. Another layout gets a tensor of its own: a colocated worker only, since a
    prefill or decode worker must ship the draft's KV with the target's. So does a draft beside a target
    split across tensor-parallel ranks (``is_target_split``: ``shape`` is one rank's; the draft runs whole on
    rank 0, and the other ranks' caches hold the target's layers only).
    """
    if tuple(shape[1:]) == tuple(draft_shape[1:]) and not is_target_split:
        kv_cache = allocate((shape[0] + draft_shape[0], *shape[1:]))
        return kv_cache, kv_cache[shape[0]:]
    if role is not PipelineRole.PrefillAndDecode:
        raise ConfigError(
            f"draft_model.model_path: a {role.value} worker ships the draft's KV with the target's, which needs "
            f"the same KV layout per layer (kv heads x head dim): target {shape[4]}x{shape[5]}, draft "
            f"{draft_shape[4]}x{draft_shape[5]}; use such a draft, or the colocated role")
    kv_cache = allocate(shape)
    return kv_cache, torch.zeros(draft_shape, dtype=kv_cache.dtype, device=kv_cache.device)
