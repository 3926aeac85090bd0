"""The HTTP side of ``lmlab serve``: OpenAI's routes on FastAPI, served by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (for a run with a chat template),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``. With ``"stream": true`` a completion
comes as server-sent events, ``data: {json}\\n\\n`` chunks ending with ``data: [DONE]``; a client that
goes away mid-stream frees its row at the scheduler's next step. Every refusal is the OpenAI error
object with a 4xx status (a failure of the model while decoding: 500, ``server_error``); none of
them stops the server.
"""

import asyncio
import hmac
import ipaddress
import json
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from lmlab.errors import UserError, warn
from lmlab.serve.protocol import ApiError, ChatRequest, CompletionRequest, error_body, parse
from lmlab.serve.scheduler import Job


# A body past this is refused before it is parsed: 64 bytes a token of context is far more than any
# JSON spelling of a prompt that fits (an escaped character is 6 bytes), and a floor for small models.
MIN_BODY_LIMIT = 1 << 20
BODY_BYTES_PER_TOKEN = 64


def create_app(service, scheduler_thread: bool = True, api_key: str | None = None):
    """The app over ``service`` (a :class:`~lmlab.serve.service.Service`). With ``scheduler_thread``
    its scheduler runs in a background thread while the app does; else the caller runs it. With
    ``api_key`` every route wants ``Authorization: Bearer <api_key>`` (:class:`RequireKey`)."""
    app = _routes(service, scheduler_thread)
    return RequireKey(app, api_key) if api_key is not None else app


def _routes(service, scheduler_thread: bool) -> FastAPI:

    @asynccontextmanager
    async def lifespan(app):
        if scheduler_thread:
            service.start()
        try:
            yield
        finally:
            if scheduler_thread:
                service.stop()

    app = FastAPI(title="lmlab serve", description=f"OpenAI-compatible endpoint for {service.model_id}",
                  lifespan=lifespan)
    app.state.service = service
    body_limit = max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * service.context)

    @app.exception_handler(ApiError)
    async def refused(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, code=code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        return JSONResponse(error_body(f"{first['msg']} at {list(first['loc'])}"), status_code=400)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "lmlab"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await _read_body(request, body_limit))
        return await _respond(service, service.completion_jobs(body), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatRequest, await _read_body(request, body_limit))
        return await _respond(service, service.chat_jobs(body), body, request, chat=True)

    return app


class RequireKey:
    """ASGI middleware: a request without ``Authorization: Bearer <key>`` gets OpenAI's 401 error object.

    Plain ASGI rather than an ``@app.middleware``: Starlette's BaseHTTPMiddleware would sit between
    a streamed response and its client, and the handlers' disconnect checks."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided" if given else
                   "You didn't provide an API key: send it as 'Authorization: Bearer <key>'")
        response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes ``limit`` bytes: never held whole in memory."""
    def too_large():
        return ApiError(413, f"the request body is over {limit} bytes, more than any prompt this model's context "
                             "can hold", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def _respond(service, jobs: list[Job], body, request: Request, chat: bool):
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.model_id}
    if body.stream:  # one job: the protocol refuses a streamed request of several
        return StreamingResponse(_stream(service, jobs[0], meta, chat, body.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    waiting = set(range(len(jobs)))
    for job in jobs:
        _submit(service, job)
    try:
        while waiting:
            for i in list(waiting):
                job = jobs[i]
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=1 / len(waiting))
                except asyncio.TimeoutError:
                    continue
                if kind == "done":
                    waiting.discard(i)
                elif kind == "error":
                    raise ApiError(500, payload, type="server_error")
            if waiting and await request.is_disconnected():
                return None  # nobody to answer; the finally gives the rows back
    finally:
        for i in waiting:
            service.scheduler.cancel(jobs[i])  # the handler was cancelled (client gone) or failed
    tokenizer = service.tokenizer
    choices = []
    for index, job in enumerate(jobs):
        c = job.completion
        if chat:
            logprobs = _chat_logprobs(tokenizer, job) if job.logprobs is not None else None
            choices.append({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
        else:
            prompt = tokenizer.decode(job.ids) if job.echo else ""
            logprobs = _logprobs(tokenizer, job, prompt) if job.logprobs is not None else None
            choices.append({"index": index, "text": prompt + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    usage = _usage(jobs)
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices, "usage": usage}


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _logprobs(tokenizer, job: Job, prompt: str) -> dict:
    """The completions API's logprobs: per token its text, log-probability, the most likely tokens
    and where it starts in the choice's text (the prompt's tokens first when echoed; the first of them
    has no log-probability, nothing coming before it)."""
    tokens, values, tops, offsets = [], [], [], []
    at = 0
    entries = []
    if job.echo:
        entries.append((job.ids[0], None, None))
        entries += [(s.token, s.logprob, s.top) for s in job.prompt_scores] if job.prompt_scores else \
            [(t, None, None) for t in job.ids[1:]]
    entries += [(s.token, s.logprob, s.top) for s in job.scores]
    for token, value, top in entries:
        text = _piece(tokenizer, token)
        tokens.append(text)
        values.append(value)
        tops.append(None if top is None else {_piece(tokenizer, t): v for t, v in top})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tokenizer, job: Job) -> dict:
    """The chat API's logprobs: per new token its text, bytes, log-probability and the most likely ones."""
    def entry(token: int, value: float) -> dict:
        text = _piece(tokenizer, token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, v) for t, v in s.top]}
                        for s in job.scores], "refusal": None}


def _submit(service, job: Job) -> None:
    job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
    service.scheduler.submit(job)


def _usage(jobs: Job | list[Job]) -> dict:
    """Tokens read and made: each prompt counted once however many copies completed it."""
    jobs = [jobs] if isinstance(jobs, Job) else jobs
    read = sum(len(j.ids) for j in {id(j.ids): j for j in jobs}.values())  # copies share their prompt's list
    made = sum(len(j.completion.tokens) for j in jobs)
    return {"prompt_tokens": read, "completion_tokens": made, "total_tokens": read + made}


async def _stream(service, job: Job, meta: dict, chat: bool, include_usage: bool):
    """The SSE body; submitted only once the response starts, so a request never sent never runs."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(data) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunk(text: str | None = None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return event({**meta, "object": obj, "choices": [choice]})

    finished = False
    _submit(service, job)
    try:
        if chat:
            yield chunk(role=True)
        while True:
            kind, payload = await job.events.get()
            if kind == "text":
                yield chunk(payload)
            elif kind == "done":
                finished = True
                yield chunk(finish=job.completion.finish_reason)
                if include_usage:
                    yield event({**meta, "object": obj, "choices": [], "usage": _usage(job)})
                yield "data: [DONE]\n\n"
                return
            else:
                finished = True
                yield event(error_body(payload, "server_error"))
                return
    finally:
        if not finished:
            service.scheduler.cancel(job)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); a UserError when the address is taken or unknown."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", key="--port") from exc
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: what it resolves to
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The one-line warning for a server others can reach and use without a key, else None."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"lmlab serve listens on {host} without an API key: anyone who can reach this port can use the "
            "model; give --api-key (or set LMLAB_API_KEY)")


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 32, cache: str | None = None,
          model_name: str | None = None, overrides: list[str] = (), api_key: str | None = None) -> int:
    """``lmlab serve``: load the run, print the URL, serve until Ctrl-C (KeyboardInterrupt, raised on
    to the command: "interrupted", exit 130).

    uvicorn runs in a background thread and the scheduler in this one, the thread that loaded the
    model (see :meth:`~lmlab.serve.scheduler.Scheduler.run`); Ctrl-C ends the scheduler here, whose
    open requests, and any that arrive after, are told the server is shutting down, then uvicorn."""
    import uvicorn

    from lmlab.serve.service import Service

    service = Service.from_run(Path(run_dir), overrides=overrides, model_name=model_name, max_batch=max_batch,
                               cache=cache)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    chat = "completions and chat" if service.template is not None else "completions (no chat template)"
    decoding = service.request_options
    settable = f"; requests may set {', '.join(decoding.fields)}" if decoding.fields else ""
    print(f"lmlab serve: model {service.model_id!r}, {service.context} tokens of context, {chat}; up to "
          f"{max_batch} requests decoded together ({service.scheduler.cache} cache), by "
          f"{decoding.decoder.name!r}{settable}", flush=True)
    if (warning := exposure_warning(host, api_key)) is not None:
        warn(warning)
    guarded = "; requests need the API key (Authorization: Bearer)" if api_key is not None else ""
    print(f"lmlab serve: http://{shown}:{bound}/v1  (Ctrl-C to stop){guarded}", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(service, scheduler_thread=False, api_key=api_key),
                                           log_level="info", timeout_graceful_shutdown=3))

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            service.scheduler.stop()  # the server ended on its own (it failed): so does the scheduler

    thread = threading.Thread(target=http, name="lmlab-serve-http", daemon=True)
    thread.start()
    try:
        service.scheduler.run()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    return 0 if server.started else 1  # the loop ended without Ctrl-C: uvicorn stopped (failed to start: it said why)
