"""The OpenAI-compatible HTTP API over a ServedModel, for where vLLM is not: FastAPI (pydantic
validates each request), sse-starlette for streaming, uvicorn to run it. /v1/models lists the
one model under its id (recipe + manifest digest); /v1/chat/completions answers, streamed or
not. Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx
status for a bad request, and the server goes on serving.

Clients are hostile until bounded, so each request is, before it costs much:
- its body: over `body_bytes` (the longest prompt allowed, JSON-escaped, plus BODY_SLACK_BYTES) is
  413, by its Content-Length before any of it is read, else once the bytes of a chunked body pass it;
  then it is parsed by pydantic straight into the request's fields (no dict of it kept beside them:
  json.loads of a body padded with `[[],[],...]` in an ignored field held 29 times its size for the
  whole generation), and dropped before the request waits on the model. JSON that is not text (a lone
  UTF-16 surrogate escape) is a 400 there;
- how many at once: past MAX_IN_FLIGHT chat completions (reading, queued for the model, generating
  or streaming) a request is 429 at once, so the queue for the model stays bounded;
- its fields: message count and parts, stop strings, integer ranges (400 naming the field);
- its size: prompt plus completion within the context and the KV cache's tokens (400);
- its prompt: over context × CHARS_PER_TOKEN characters is 400 before tokenizing, then over the
  context in tokens as before;
- its generation: a client that goes away ends it (streamed or not) and frees its place in the
  batch; one still going `time_limit` seconds after it came is cut there and answered with the text so far and finish_reason
  "length", as when max_tokens runs out (a stream can no longer change its status to an error).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from stages.inference.batching import Generated
from stages.inference.generation import ServedModel, Settings

# Text averages about 4 characters a token (code 3-4, Chinese 2.5; at most 6 in 5,000 real conversations
# through Qwen3's tokenizer): at 16 only padding (long runs of one character) that fits could be refused.
CHARS_PER_TOKEN = 16
JSON_BYTES_PER_CHAR = 6  # the most a character takes in a JSON string: \uXXXX, json.dumps' default for non-ASCII
BODY_SLACK_BYTES = 1 << 20  # the rest of a request: message wrappers, fields this server ignores (tools)
MAX_IN_FLIGHT = 256  # answers the batch holds or queues at once: a longer queue only waits past clients' timeouts
OTHER_BODY_BYTES = 4096  # a body sent to any other path (none takes one): bounded too, since those are not counted
MAX_MESSAGES = 2048  # more turns than a conversation has; each is validated and templated before the token check
MAX_CONTENT_PARTS = 64  # text parts of one message: clients send one or a few
MAX_STOPS = 4  # OpenAI's API takes up to 4 stop strings
# transformers' StopStringCriteria is set up under the model lock in time ~ vocabulary × stop characters
# (about 1 s + 0.05 s a character for Qwen3's 151k tokens); stop markers are short ("\n\n", "</answer>";
# Llama 3's "<|start_header_id|>user<|end_header_id|>" is 40).
MAX_STOP_CHARS = 64
MAX_TOKENS = 2**31 - 1  # max_tokens: a 32-bit count, beyond any context; past the context it is 400 as well
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # OpenAI's seed is a 64-bit integer (accepted; the batch shares one generator)
TIME_LIMIT_S = 60.0  # one generation's wall time, queued and decoding: a minute is thousands of GPU tokens
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    @field_validator("content")
    @classmethod
    def few_parts(cls, content):
        if not isinstance(content, str) and len(content) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} parts")
        return content

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
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Literal[1] = 1
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    @field_validator("stop")
    @classmethod
    def few_short_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        return stop


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Bounded:
    """ASGI middleware: what a request may cost before the app sees it. A chat completion past
    `in_flight` at once is 429; a body over `body_bytes` (OTHER_BODY_BYTES on any other path, whose
    requests are not counted: 400 uploads of a megabyte each to a mistyped path were all held) is
    413, by its Content-Length before any of it is read, else as soon as the bytes read of a chunked
    body pass the bound."""

    def __init__(self, app, body_bytes: int, in_flight: int):
        self.app, self.body_bytes, self.in_flight, self.busy = app, body_bytes, in_flight, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"] == "/v1/chat/completions"
        if counted and self.busy >= self.in_flight:
            return await error(429, f"this server is answering {self.busy} requests already, its limit; retry "
                                    f"shortly", code="rate_limit_exceeded", kind="requests",
                               headers={"Retry-After": "1"})(scope, receive, send)
        self.busy += counted
        try:
            await self._bounded(scope, receive, send)
        finally:
            self.busy -= counted

    async def _bounded(self, scope, receive, send):
        limit = self.body_bytes if scope["path"] == "/v1/chat/completions" else OTHER_BODY_BYTES
        stated = Headers(scope=scope).get("content-length")
        if stated is not None and int(stated) > limit:
            return await self._too_large(scope, receive, send, limit)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                return await self._too_large(scope, receive, send, limit)
            more = message.get("more_body", False)
        replayed = False

        async def replay():  # the body read (and let go of here), then what the client sends next (its disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed, data = True, bytes(body)
            body.clear()
            return {"type": "http.request", "body": data, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, scope, receive, send, limit: int):
        why = ("the longest prompt its model takes, JSON-escaped); shorten the messages" if limit == self.body_bytes
               else "on this path, which takes no body)")
        return error(413, f"the request body is over {limit} bytes, this server's limit ({why}",
                     code="request_too_large")(scope, receive, send)


def build_app(model: ServedModel, model_id: str, extra_card: dict | None = None,
              time_limit: float = TIME_LIMIT_S) -> FastAPI:
    """The app serving `model` as `model_id`; extra_card adds fields to its /v1/models entry;
    a generation stops `time_limit` seconds after its request came. app.state.limits says the bounds."""
    app = FastAPI(title=f"mindxtrain: {model_id}")
    max_chars = model.context_length * CHARS_PER_TOKEN
    body_bytes = max_chars * JSON_BYTES_PER_CHAR + BODY_SLACK_BYTES
    app.add_middleware(Bounded, body_bytes=body_bytes, in_flight=MAX_IN_FLIGHT)
    app.state.limits = (f"body {body_bytes / 2**20:.1f} MiB, prompt {max_chars} characters and "
                        f"{model.context_length} tokens, {MAX_MESSAGES} messages, {MAX_STOPS} stops of "
                        f"{MAX_STOP_CHARS} characters, {MAX_IN_FLIGHT} requests at once, {time_limit:g} s a generation, "
                        f"KV cache {model.kv_tokens} tokens shared by the batch")
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

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):  # a defect here, still answered in OpenAI's shape
        return error(500, f"the server failed on this request ({type(e).__name__}); it goes on serving others",
                     kind="server_error")

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
    async def chat(request: Request):
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            # as FastAPI parses only JSON bodies: a web page's form or text/plain post (no CORS preflight) is refused
            raise APIError(400, f"the request body must be JSON (Content-Type: application/json), not {media[:64]!r}")
        body = b"".join([part async for part in request.stream()])  # (stream(): Request keeps no copy)
        try:
            req = ChatRequest.model_validate_json(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        del body
        known(req.model)
        messages = [m.plain() for m in req.messages]
        chars = sum(len(m["content"]) for m in messages)
        if chars > max_chars:
            raise APIError(400, f"This model's maximum context length is {model.context_length} tokens. However, "
                                f"your messages are {chars} characters, more than the {max_chars} this server "
                                f"tokenizes. Please reduce the length of the messages.",
                           "messages", "context_length_exceeded")
        try:
            ids = await run_in_threadpool(model.prompt_ids, messages)
        except TemplateError as e:
            raise APIError(400, f"the model's chat template refuses these messages: {e}", "messages") from None
        settings = decoding(req, len(ids), model.context_length, time_limit)
        reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(chunks(model, ids, settings, reply, include_usage))
        answer = await unless_gone(request, model.complete(ids, settings))
        if answer is None:
            return error(499, "the client closed the request", code="client_closed_request")
        return {**reply, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                             "finish_reason": answer.finish, "logprobs": None}],
                "usage": usage(len(ids), answer)}

    return app


async def unless_gone(request: Request, work) -> Generated | None:
    """Awaits `work`, a generation; a client that goes away meanwhile cancels it, which ends the
    generation at the next step (or takes it out of the queue for the model): None then."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()  # a no-op once it is done


def decoding(req: ChatRequest, prompt_tokens: int, context: int, time_limit: float) -> Settings:
    """The request's decoding settings, or a 400 when prompt and completion cannot fit the context."""
    asked = req.max_completion_tokens or req.max_tokens
    room = context - prompt_tokens
    if room < 1 or (asked is not None and asked > room):
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_tokens + (asked or 1)} tokens ({prompt_tokens} in the messages, {asked or 1} "
                            f"in the completion). Please reduce the length of the messages or completion.",
                       "messages", "context_length_exceeded")
    stop = [s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or []) if s]  # "" stops nothing
    return Settings(max_new_tokens=asked or room, temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, stop=stop, time_limit=time_limit)


def usage(prompt_tokens: int, answer: Generated) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(answer.ids),
            "total_tokens": prompt_tokens + len(answer.ids)}


async def chunks(model: ServedModel, ids: list[int], settings: Settings, reply: dict, include_usage: bool):
    """The streamed answer as OpenAI's chat.completion.chunk events, then [DONE]; a client that
    goes away stops the generation (sse-starlette cancels this generator, which closes the model's)."""
    head = {**reply, "object": "chat.completion.chunk"}

    def chunk(delta: dict, finish=None) -> dict:
        return {"data": json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                          "logprobs": None}]})}

    yield chunk({"role": "assistant", "content": ""})
    async with aclosing(model.stream(ids, settings)) as pieces:
        async for piece in pieces:
            if isinstance(piece, Generated):
                yield chunk({}, piece.finish)
                if include_usage:
                    yield {"data": json.dumps({**head, "choices": [], "usage": usage(len(ids), piece)})}
            else:
                yield chunk({"content": piece})
    yield {"data": "[DONE]"}
