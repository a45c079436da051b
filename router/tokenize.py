"""vLLM's tokenizer endpoints on the router: POST /tokenize, POST /detokenize, GET /tokenizer_info.

The served tokenizer answers them in vLLM's shapes, so clients that tokenize through the server
(lm-eval's remote tokenizer backend, which ``local-completions`` picks by itself when these answer;
guidellm; prompt-length checks) need no copy of the checkpoint. Nothing here reaches a worker.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from router.chat_messages import template_tools
from router.errors import APIError, bad_request
from router.openai_schema import ChatMessage, ChatTemplateOptions, ChatTool
from router.preprocess import render_chat
from router.served_model import ServedModel
from router.tokenizer_thread import run_tokenizer_work


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server would not honour is a 400

    model: str | None = None


class TokenizeCompletion(_Body):
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChat(ChatTemplateOptions, _Body):
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class Detokenize(_Body):
    tokens: list[StrictInt]


def install_tokenizer_routes(app: FastAPI, model: ServedModel, servable_length: Callable[[], int | None]) -> None:
    """``servable_length``: the longest sequence the live workers hold (``max_model_len``, as /v1/models says)."""
    tokenizer = model.tokenizer

    def check_model(name: str | None) -> None:
        if name is not None and not model.serves(name):
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{model.name}`.",
                           param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletion | TokenizeChat) -> dict[str, Any]:
        check_model(body.model)

        def encode() -> list[int]:
            if isinstance(body, TokenizeChat):
                return render_chat(model, body, template_tools(body.tools))
            return list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        ids = await run_tokenizer_work(encode)
        return {"count": len(ids), "max_model_len": servable_length(), "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> dict[str, str]:
        check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {model.vocab_size})",
                              param="tokens")
        return {"prompt": await run_tokenizer_work(lambda: tokenizer.decode(body.tokens))}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": model.max_length,
            "vocab_size": model.vocab_size,
        }
