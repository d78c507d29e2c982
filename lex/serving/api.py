"""The OpenAI-compatible HTTP API of `lex serve`, on FastAPI: /v1/models, /v1/completions, /v1/chat/completions.

Requests are checked before anything is queued: a body that is not UTF-8 or not JSON, a missing or unknown field,
a value out of range, an unknown model, a prompt past the limit each get a 400 (404 for the model) whose
`error.param` names the field, in OpenAI's error shape; the server goes on serving. A request that is accepted is
handed to the engine (engine.py) and answered when its last token is chosen, or token by token as server-sent
events with `stream: true`. A client that disconnects cancels its request: its row leaves the batch at the next
step.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .engine import Engine, Event, Request as EngineRequest, Sampling
from .states import reading_plan


class BadRequest(Exception):
    """A request the server refuses: its status, the field at fault (`param`) and why."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Common(BaseModel):
    """The fields both endpoints take; any other field is refused by name."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(Common):
    prompt: str


def field_name(location: tuple) -> str:
    return ".".join(str(part) for part in location if part != "body") or "body"


class Limits(BaseModel):
    max_new_tokens: int
    max_prompt_tokens: int
    default_max_tokens: int


def build_app(engine: Engine, model_name: str, limits: Limits) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`; the engine stops once the server has finished the
    requests in flight (uvicorn's shutdown, SIGTERM included)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="lex serve", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(BadRequest)
    async def refuse(request: Request, error: BadRequest) -> JSONResponse:
        return JSONResponse({"error": {"message": error.message, "type": error.kind, "param": error.param,
                                       "code": None}}, status_code=error.status)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "lex"}]}

    @app.get("/health")
    async def health() -> dict:
        """Liveness, and what the engine is doing: requests in flight, the largest batch a step has decoded, the
        tokens decoding steps have made and the seconds they took."""
        return {"status": "ok", "in_flight": engine.in_flight, "largest_batch": engine.largest_batch,
                "decoded_tokens": engine.decoded_tokens, "decoding_steps": engine.decoding_steps,
                "decoding_seconds": engine.decoding_seconds}

    async def parse(request: Request, schema: type[Common]) -> Common:
        raw = await request.body()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadRequest(f"the request body is not UTF-8 (byte {error.start})", "body") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as error:
            raise BadRequest(f"the request body is not JSON: {error}", "body") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object", "body")
        try:
            parsed = schema.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            name = field_name(first["loc"])
            message = {"missing": f"{name} is required", "extra_forbidden": f"{name} is not a field this server "
                       f"takes (allowed: {', '.join(schema.model_fields)})"}.get(first["type"],
                                                                                f"{name}: {first['msg']}")
            raise BadRequest(message, name) from None
        if parsed.model != model_name:
            raise BadRequest(f"model {parsed.model!r} is not served here (allowed: {model_name!r})", "model", 404,
                             "model_not_found")
        return parsed

    def sampling(body: Common, max_tokens: int | None, name: str) -> Sampling:
        count = limits.default_max_tokens if max_tokens is None else max_tokens
        if not 1 <= count <= limits.max_new_tokens:
            raise BadRequest(f"{name}={count}: allowed 1 to {limits.max_new_tokens} (--max_new_tokens_limit)", name)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not stop for stop in stops):
            raise BadRequest("stop: at most 4 non-empty strings", "stop")
        return Sampling(count, body.temperature, body.top_p, body.seed, tuple(stops))

    def plan(prompt_param: str, messages: list[dict] | None = None, prompt: str | None = None
             ) -> tuple[list[int], list[int]]:
        try:
            tokens, segments = reading_plan(engine.tokenizer, messages, prompt)
        except ValueError as error:  # no chat template
            raise BadRequest(f"{prompt_param}: {error}", prompt_param) from None
        if not tokens:
            raise BadRequest(f"{prompt_param}: the prompt holds no tokens", prompt_param)
        if len(tokens) > limits.max_prompt_tokens:
            raise BadRequest(f"{prompt_param}: {len(tokens)} prompt tokens, past --max_prompt_tokens "
                             f"{limits.max_prompt_tokens}", prompt_param)
        return tokens, segments

    async def answer(http: Request, kind: str, tokens: list[int], segments: list[int], options: Sampling,
                     body: Common):
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = EngineRequest(request_id, tokens, segments, options,
                            lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        engine.submit(job)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(job, events, kind, include_usage), media_type="text/event-stream")
        text, last = [], None
        try:
            while last is None or (last.finish_reason is None and last.error is None):
                getter = asyncio.ensure_future(events.get())
                while not getter.done():
                    await asyncio.wait([getter], timeout=0.5)
                    if not getter.done() and await http.is_disconnected():
                        getter.cancel()
                        job.cancelled.set()
                        return JSONResponse({}, status_code=499)
                last = getter.result()
                text.append(last.text)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if last.error is not None:
            raise BadRequest(f"the model failed on this request: {last.error}", None, 500, "server_error")
        return JSONResponse(response(job, kind, "".join(text), last))

    def response(job: EngineRequest, kind: str, text: str, last: Event) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat"
                  else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = last.finish_reason
        return {"id": job.id, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage(last)}

    def usage(last: Event) -> dict:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}

    async def stream(job: EngineRequest, events: asyncio.Queue, kind: str, include_usage: bool
                     ) -> AsyncIterator[str]:
        """Server-sent events as OpenAI's: a chunk per piece of text, the last with its finish_reason, then
        the usage if asked, then [DONE]; an error as an event with an `error` object."""
        created = int(time.time())
        base = {"id": job.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created, "model": model_name}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if kind == "chat":
                delta = ({"role": "assistant", "content": ""} if first else {} if text is None
                         else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps(base | {'choices': [choice]})}\n\n"

        try:
            if kind == "chat":
                yield chunk(None, None, first=True)
            while True:
                event = await events.get()
                if event.error is not None:
                    yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
                    break
                if event.text:
                    yield chunk(event.text, None)
                if event.finish_reason is not None:
                    yield chunk(None, event.finish_reason)
                    if include_usage:
                        yield f"data: {json.dumps(base | {'choices': [], 'usage': usage(event)})}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the answer ended): the row leaves the batch at the next step
            job.cancelled.set()

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body = await parse(http, ChatRequest)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        options = sampling(body, getattr(body, name), name)
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        tokens, segments = plan("messages", messages=messages)
        return await answer(http, "chat", tokens, segments, options, body)

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await parse(http, CompletionRequest)
        options = sampling(body, body.max_tokens, "max_tokens")
        tokens, segments = plan("prompt", prompt=body.prompt)
        return await answer(http, "completion", tokens, segments, options, body)

    return app


__all__ = ["BadRequest", "Limits", "build_app"]
