"""OpenAI's Chat Completions and Completions on the router: POST /v1/chat/completions and POST /v1/completions.

Both requests are already what the serving path runs (router/params.py prepares them as they are), so their
doors translate nothing; their formatters are router/openai/format.py's.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.openai.format import ChatFormatter, CompletionFormatter
from router.openai.request import ChatCompletionRequest, CompletionRequest
from router.serving import FrontDoor, ServingContext, serve


def _as_is(req: Any, _model: str, _context: dict[str, Any]) -> Any:
    return req


CHAT = FrontDoor(ChatCompletionRequest, "chatcmpl-", _as_is,
                 lambda _req, prepared, ctx, created: ChatFormatter(prepared, ctx.tokenizer, created))
COMPLETION = FrontDoor(CompletionRequest, "cmpl-", _as_is,
                       lambda _req, prepared, ctx, created: CompletionFormatter(prepared, ctx.tokenizer, created))


def install_openai_api(app: FastAPI, ctx: ServingContext) -> None:
    """Add the chat and completion endpoints to the router's `app`, served with `ctx`."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's legacy completions (text or token-id prompt, echo, legacy logprobs)."""
        return await serve(request, COMPLETION, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions (the model's chat template renders the messages)."""
        return await serve(request, CHAT, ctx)
