"""Which Hugging Face architectures Tandem can run, and the model class for a checkpoint's config."""

from __future__ import annotations

from pipeline.models.gemma3 import Gemma3ForCausalLM
from pipeline.models.llama import LlamaFamilyForCausalLM
from pipeline.models.llama_moe import LlamaMoeFamilyForCausalLM
from pipeline.checkpoint_errors import CheckpointError

SUPPORTED_ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "MistralForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3MoeForCausalLM": LlamaMoeFamilyForCausalLM,
    "MixtralForCausalLM": LlamaMoeFamilyForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def resolve_model_class(hf_config) -> type:
    """The model class for ``hf_config.architectures``; ``CheckpointError`` listing the supported ones otherwise."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    found = ", ".join(architectures) if architectures else "(none named in config.json)"
    raise CheckpointError(f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
