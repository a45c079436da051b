"""The built-in model: a small random-weight Llama-family checkpoint with its own tokenizer.

It is written once in Hugging Face format (config.json, model.safetensors, tokenizer files with a
chat template) and then loaded by the same code path as any real checkpoint. Its output is noise:
it exists so that Tandem runs end to end on a machine with no model hub. Tests use the same
factory with other architectures and sizes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BUILTIN_NOTICE = (
    "Using Tandem's built-in model: random weights, so its output is noise. "
    "Point at a real Hugging Face checkpoint directory with --model PATH (or model.model_path in a config file)."
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = """
The quick brown fox jumps over the lazy dog. A serving system splits each request in two: prefill
reads the whole prompt at once, decode writes one token at a time. Paged attention keeps the key and
value cache in fixed-size blocks, so memory is never fragmented and prefixes can be shared.
Once upon a time, in a small town by the sea, there lived a baker who rose before the sun.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048. Punctuation, quotes "like this", and (parentheses)!
def main():\n    print("hello, world")\n    return 0\n
Tokens, logits, softmax, temperature, top-p, top-k: the vocabulary of sampling. Hello there, how are you?
I am fine, thank you. What is the capital of France? Paris is the capital of France.
"""

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "gemma3": "Gemma3TextConfig",
    "gpt_oss": "GptOssConfig",
    "deepseek_v3": "DeepseekV3Config",
}
# The model class where it is not the config's name with "ForCausalLM" for "Config".
_MODEL_CLASSES: dict[str, str] = {"gemma3": "Gemma3ForCausalLM"}

BUILTIN_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    initializer_range=0.05,
)


def build_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer on ``corpus`` (default: a small built-in one); returns a
    PreTrainedTokenizerFast with Tandem's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([_CORPUS] * 4 if corpus is None else corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_checkpoint(
    path: str | os.PathLike,
    architecture: str = "llama",
    tokenizer_vocab_size: int = 512,
    extra_vocab: int = 0,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of ``architecture`` (one of ``ARCHITECTURES``) to ``path``.

    The model's vocabulary is the tokenizer's plus ``extra_vocab`` unused ids (real checkpoints pad
    their embedding tables the same way). Returns ``path``.
    """
    import torch
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)} (got {architecture!r})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tokenizer_vocab_size)
    config_cls = getattr(transformers, ARCHITECTURES[architecture])
    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer) + extra_vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    settings.update(config_overrides)
    config = config_cls(**settings)
    model_cls = getattr(transformers, _MODEL_CLASSES.get(architecture, config_cls.__name__.replace("Config", "ForCausalLM")))
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if architecture == "gemma3":  # Gemma initialises its norms' weights (offsets from one) to zero: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.1)
    if architecture == "gpt_oss":  # zero expert biases and small sinks by default: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("_proj_bias") or name.endswith(".sinks"):
                    param.normal_(0.0, 1.0 if name.endswith(".sinks") else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def builtin_model_path() -> Path:
    """Directory of the built-in checkpoint, built on first use (atomically, so concurrent starts are safe)."""
    home = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
    target = home / "builtin-llama-v1"
    if (target / "config.json").is_file():
        return target
    home.mkdir(parents=True, exist_ok=True)
    logger.info("building the built-in model once at %s", target)
    staging = Path(tempfile.mkdtemp(prefix="builtin-", dir=home))
    try:
        build_checkpoint(staging, "llama", tokenizer_vocab_size=2048, **BUILTIN_CONFIG)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
