"""The bytes a vocabulary entry stands for, for a logprob entry's ``bytes`` (OpenAI: "the UTF-8 bytes of the
token", there because one character may span several tokens).

A token that is whole characters decodes to its text, whose UTF-8 are its bytes. A token that ends inside a
character decodes to U+FFFD alone, whose bytes say nothing; its own bytes come from the vocabulary entry instead:
a byte-level BPE entry (GPT-2, Llama 3, Qwen) spells each byte as one character of GPT-2's byte-to-unicode table
(transformers' ``bytes_to_unicode``), and a SentencePiece byte-fallback entry (Llama 2, Mistral) is ``<0xNN>``.
"""

from __future__ import annotations

import functools
import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The bytes of ``token_id``, whose decoded text is ``text``."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    entry = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(entry, str):
        fallback = _BYTE_FALLBACK.fullmatch(entry)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        table = _unicode_to_byte()
        if entry and all(char in table for char in entry):
            return bytes(table[char] for char in entry)
    return text.encode("utf-8")
