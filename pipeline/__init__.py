"""The pipeline every Tandem role runs. ``from pipeline import LLM, SamplingParams`` is the offline API.

Importing this package stays torch-free (the router imports ``pipeline.config`` and
``pipeline.protocol``); ``LLM`` loads the engine on first access.
"""

from pipeline.protocol import CompletionOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from pipeline.llm import LLM

        return LLM
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
