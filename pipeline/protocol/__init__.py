"""Tandem's wire vocabulary: msgspec structs only, torch-free, never pickled.

One module per socket group: ``requests`` (sampling parameters and outputs, shared by all),
``transfer`` (the KV transfer service's frames and handshake), ``cluster`` (router <-> workers),
``prefill_decode`` (decode <-> prefill workers). Each group exposes a tagged union and one typed decoder, which ``typed_socket``'s
``TypedSocket`` (the one socket wrapper) receives with.
"""

from pipeline.protocol.requests import (CompletionOutput, FinishReason, PromptLogprobs, SamplingParams, StructuredOutput,
                                        TokenLogprob)

__all__ = ["CompletionOutput", "FinishReason", "PromptLogprobs", "SamplingParams", "StructuredOutput", "TokenLogprob"]
