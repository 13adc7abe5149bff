"""The OpenAI-compatible HTTP API over a ServedModel, for where vLLM is not: FastAPI (pydantic
validates each request), sse-starlette for streaming, uvicorn to run it. /v1/models lists the
one model under its id (recipe + manifest digest); /v1/chat/completions answers, streamed or
not. Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx
status for a bad request, and the server goes on serving."""
from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException

from stages.serving.model import Answer, ServedModel, Settings


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The chat completion fields this server honours; fields it does not use are ignored, as
    OpenAI-compatible servers do, and values it cannot honour (n > 1) are refused."""
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Literal[1] = 1
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def build_app(model: ServedModel, model_id: str, extra_card: dict | None = None) -> FastAPI:
    """The app serving `model` as `model_id`; extra_card adds fields to its /v1/models entry."""
    app = FastAPI(title=f"mindxtrain: {model_id}")
    created = int(time.time())
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "mindxtrain",
            "max_model_len": model.context_length, **(extra_card or {})}

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error(e.status, e.message, e.param, e.code, e.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        return error(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", ".".join(loc) or None)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), kind=kind)

    def known(name: str) -> None:
        if name != model_id:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_id}`",
                           "model", "model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        known(name)
        return card

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        known(req.model)
        try:
            ids = await run_in_threadpool(model.prompt_ids, [m.plain() for m in req.messages])
        except TemplateError as e:
            raise APIError(400, f"the model's chat template refuses these messages: {e}", "messages") from None
        settings = decoding(req, len(ids), model.context_length)
        reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(chunks(model, ids, settings, reply, include_usage))
        answer = await run_in_threadpool(model.complete, ids, settings)
        return {**reply, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                             "finish_reason": answer.finish_reason, "logprobs": None}],
                "usage": usage(len(ids), answer)}

    return app


def decoding(req: ChatRequest, prompt_tokens: int, context: int) -> Settings:
    """The request's decoding settings, or a 400 when prompt and completion cannot fit the context."""
    asked = req.max_completion_tokens or req.max_tokens
    room = context - prompt_tokens
    if room < 1 or (asked is not None and asked > room):
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_tokens + (asked or 1)} tokens ({prompt_tokens} in the messages, {asked or 1} "
                            f"in the completion). Please reduce the length of the messages or completion.",
                       "messages", "context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else [s for s in (req.stop or []) if s]
    return Settings(max_new_tokens=asked or room, temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop)


def usage(prompt_tokens: int, answer: Answer) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": prompt_tokens + answer.completion_tokens}


async def chunks(model: ServedModel, ids: list[int], settings: Settings, reply: dict, include_usage: bool):
    """The streamed answer as OpenAI's chat.completion.chunk events, then [DONE]; a client that
    goes away stops the generation."""
    cancel = threading.Event()
    head = {**reply, "object": "chat.completion.chunk"}

    def chunk(delta: dict, finish=None) -> dict:
        return {"data": json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                          "logprobs": None}]})}

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for piece in iterate_in_threadpool(model.stream(ids, settings, cancel)):
            if isinstance(piece, Answer):
                yield chunk({}, piece.finish_reason)
                if include_usage:
                    yield {"data": json.dumps({**head, "choices": [], "usage": usage(len(ids), piece)})}
            else:
                yield chunk({"content": piece})
        yield {"data": "[DONE]"}
    finally:
        cancel.set()
