"""A realistic-size tokenizer without a model hub: byte-level BPE trained on the Python standard library.

Benchmarks whose cost depends on the vocabulary (structured output's masks) need tens of thousands of
tokens; the built-in model's corpus gives a few hundred. The standard library is large, local and
the same on every machine with this Python, so the trained tokenizer is reproducible.
"""

from __future__ import annotations

import os
import sysconfig
import time
from pathlib import Path


def read_corpus(max_bytes: int) -> tuple[list[str], dict]:
    """The standard library's .py/.txt files, in a fixed order, up to ``max_bytes`` of text.

    A 32k-token BPE learns long tokens (identifiers, words, indentation runs) from it as a real model's
    tokenizer does; site-packages is skipped so the corpus does not depend on what is installed."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith((".py", ".txt")):
                continue
            try:
                text = Path(dirpath, name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            texts.append(text)
            total += len(text.encode())
            if total >= max_bytes:
                return texts, dict(source=root, files=len(texts), bytes=total)
    return texts, dict(source=root, files=len(texts), bytes=total)


def build_local_tokenizer(vocab_size: int, corpus_mb: float, directory: Path):
    """``pipeline.builtin_model.build_tokenizer`` trained on ``corpus_mb`` of the standard library, saved
    under ``directory`` and loaded back the way the engine loads a checkpoint's; (tokenizer, info)."""
    from transformers import AutoTokenizer

    from pipeline.builtin_model import build_tokenizer

    texts, corpus = read_corpus(int(corpus_mb * 2**20))
    start = time.perf_counter()
    build_tokenizer(vocab_size, corpus=texts).save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    info = dict(requested_vocab_size=vocab_size, vocab_size=len(tokenizer), train_s=time.perf_counter() - start,
                corpus=corpus, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return tokenizer, info
