"""Request checks against the loaded model (lengths, token ids), before anything is queued."""

from __future__ import annotations

from pipeline.protocol import SamplingParams


class RequestError(ValueError):
    """A request cannot be served as asked; the message names the field and the limit."""


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_length: int) -> None:
    if not prompt_token_ids:
        raise RequestError("prompt: must contain at least one token")
    if len(prompt_token_ids) >= max_length:
        raise RequestError(
            f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within max_length={max_length}"
        )
    _check_ids("prompt", prompt_token_ids, vocab_size)
    _check_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    _check_ids("logit_bias", list(params.logit_bias), vocab_size)
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)


def _check_ids(field: str, token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{field}: token ids must be in [0, {vocab_size}) (got {bad[:5]})")


def resolve_bad_words(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, both as written and with a leading space (how it appears mid-text)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
