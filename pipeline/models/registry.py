"""Which Hugging Face architectures Tandem can run, and the model class for a checkpoint's config.

The table names each class by module, imported only when a checkpoint needs it, so the names can be
checked (``supported_architecture``) without loading torch: a launcher refuses a checkpoint that way.
"""

from __future__ import annotations

import importlib

from pipeline.checkpoint_errors import CheckpointError

SUPPORTED_ARCHITECTURES: dict[str, str] = {  # architecture -> "module:class"
    "LlamaForCausalLM": "pipeline.models.llama:LlamaFamilyForCausalLM",
    "MistralForCausalLM": "pipeline.models.llama:LlamaFamilyForCausalLM",
    "Qwen2ForCausalLM": "pipeline.models.llama:LlamaFamilyForCausalLM",
    "Qwen3ForCausalLM": "pipeline.models.llama:LlamaFamilyForCausalLM",
    "Qwen3MoeForCausalLM": "pipeline.models.llama_moe:LlamaMoeFamilyForCausalLM",
    "MixtralForCausalLM": "pipeline.models.llama_moe:LlamaMoeFamilyForCausalLM",
    "Gemma3ForCausalLM": "pipeline.models.gemma3:Gemma3ForCausalLM",
    "GptOssForCausalLM": "pipeline.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV3ForCausalLM": "pipeline.models.deepseek_v3:DeepseekV3ForCausalLM",
}


def supported_architecture(architectures: list[str]) -> str:
    """The first of ``architectures`` (config.json's list) Tandem runs; ``CheckpointError`` listing the
    supported ones otherwise."""
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(architectures) if architectures else "(none named in config.json)"
    raise CheckpointError(f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def resolve_model_class(hf_config) -> type:
    """The model class for ``hf_config.architectures``; ``CheckpointError`` listing the supported ones otherwise."""
    name = supported_architecture(list(getattr(hf_config, "architectures", None) or []))
    module_name, class_name = SUPPORTED_ARCHITECTURES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
