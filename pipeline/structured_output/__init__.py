"""Structured output: a grammar's token bitmask applied to the logits before sampling.

A grammar backend (``grammar.py`` says what one is; ``llguidance_backend.py``, the default, and
``xgrammar_backend.py``; ``backend.py`` picks one by name) turns a request's ``StructuredOutput`` (JSON
schema, JSON object, regex, choice, Lark grammar) into a compiled grammar (once per distinct constraint,
cached) and a per-request matcher that says which tokens may come next and when the grammar is complete.
The engine advances a request's matcher with every token it emits and finishes the request ("stop") when
the grammar ends; the sampler masks the logits of constrained rows (``pipeline/sampling_metadata.py``).
"""
