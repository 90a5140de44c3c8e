"""An OpenAI-compatible HTTP API over an :class:`~dsa.serve.engine_loop.EngineLoop` (FastAPI).

Routes: ``GET /health`` (no key), ``GET /v1/models``, ``POST /v1/completions`` (a prompt as a
string or token ids, or a list of them), ``POST /v1/chat/completions`` (the tokenizer's chat
template), both streamed as server-sent events ending in ``data: [DONE]`` when ``stream`` is
true, and ``GET /metrics`` (Prometheus text format). Sampling fields map to
:class:`~dsa.engine.sampling.SamplingParams`. Errors are ``{"error": {"message", "type", "param",
"code"}}``: 400 for malformed JSON, wrong types, out-of-range values and requests that can never
fit (naming the limit), 401 on ``/v1`` routes without the right key (when one is set), 404 for an
unknown model or route, 503 while shutting down and when ``max_queued`` requests already wait
(with ``Retry-After``). A client that disconnects aborts its requests, which frees their blocks.
A request still running after ``request_timeout`` seconds, or when :meth:`_Server.drain` gives
up waiting, is aborted: a stream ends with a chunk whose ``finish_reason`` is ``"abort"``, a
non-streamed request gets a 504 (timeout) or 503 (shutdown) error. :meth:`_Server.end_now` (a
second signal) does the same to every request at once, without waiting for the engine's step.
One log line per request.
"""
import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsa.engine.output import Delta
from dsa.engine.sampling import SamplingParams
from dsa.serve.chat_template import ChatTemplateError
from dsa.serve.engine_loop import EngineLoop, Submission
from dsa.serve.metrics import LatencyMetrics, prometheus_text

log = logging.getLogger("dsa.serve")
CHAT_DEFAULT_MAX_TOKENS = 256  # chat without max_tokens: this many, or what is left of the context
ABORT_GRACE_S = 5.0  # at shutdown, how long aborted requests get to send their last chunk


# ---- requests ----------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampled(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Sampled):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, ...: passed to the template
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Sampled):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        """The error as OpenAI sends it: a response's JSON body, or a stream's last event."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _sampling(body: _Sampled, max_tokens: int, logprobs: int | None, defaults: dict) -> SamplingParams:
    """The request's sampling; what it leaves out of temperature / top_p / top_k / min_p comes from
    ``defaults`` (the checkpoint's generation_config.json)."""
    if body.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name}: not supported (give 0)", name)
    given = {**defaults, **{k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                          "stop_token_ids") if getattr(body, k) is not None}}
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=body.ignore_eos, **given)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(":")[0]) from None


class _Server:
    """The handlers' shared state: the LLM (tokenizer, engine limits), its loop, the served name,
    the admission limits and the calls in flight."""

    def __init__(self, llm, loop: EngineLoop, model_name: str, max_queued: int | None = None,
                 request_timeout: float | None = None):
        self.llm, self.loop, self.model_name = llm, loop, model_name
        self.sampling_defaults = getattr(llm, "generation_defaults", {})
        self.max_queued, self.request_timeout = max_queued, request_timeout
        self.calls = set()  # _Call objects in flight
        self.draining = False
        self.ending_now = False  # end_now was called: the drain waits no longer
        self.created = int(time.time())
        self.latency = LatencyMetrics()  # TTFT, ITL, end-to-end and queue time histograms
        engine = llm.engine
        self.limit = min(engine.max_model_len, engine.capacity_tokens)
        self.limit_name = (engine.max_model_len_name if self.limit == engine.max_model_len
                           else f"the cache pool ({engine.num_blocks} blocks of {engine.config.block_size})")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model: {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def check_fits(self, ids: list, max_tokens: int) -> None:
        total = len(ids) + max_tokens
        if total > self.limit:
            param = "prompt" if len(ids) >= self.limit else "max_tokens"
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens exceed the "
                           f"limit of {self.limit} tokens ({self.limit_name})", param)

    def check(self, ids: list, sampling: SamplingParams) -> list:
        self.check_fits(ids, sampling.max_tokens)
        try:
            return self.llm.engine.check_request(ids, sampling)
        except ValueError as e:
            raise APIError(400, str(e).replace("prompt_ids", "prompt"), "prompt") from None

    def encode(self, prompt) -> list:
        try:
            return self.llm.encode(prompt)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), "prompt") from None

    def token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return str(token_id) if tok is None else tok.token_text(token_id)

    def token_bytes(self, token_id: int) -> list:
        """The token's own bytes (a byte of a longer character is that byte, not U+FFFD's UTF-8);
        only chat asks, and chat needs a tokenizer."""
        return list(self.llm.tokenizer.token_bytes(token_id))

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error")

    def admit(self, call: "_Call") -> None:
        """Submit the call's requests, or 503 when shutting down or ``max_queued`` requests wait."""
        self.check_open()
        queued = self.loop.queued()
        if self.max_queued is not None and queued >= self.max_queued:
            raise APIError(503, f"the server is busy: {queued} requests are waiting (--max-queued "
                           f"{self.max_queued}); retry later", type="server_error", headers={"Retry-After": "1"})
        if self.request_timeout is not None:
            call.deadline = time.monotonic() + self.request_timeout
        self.calls.add(call)
        for s in call.subs:
            self.loop.submit(s)

    def abort_unfinished(self, subs: list) -> None:
        for s in subs:
            if not s.finished:
                self.loop.abort(s)

    async def drain(self, timeout: float) -> None:
        """Shut down: refuse new requests (503), give the calls in flight up to ``timeout`` seconds
        (less when :meth:`end_now` is called meanwhile), then abort the rest and give them
        ABORT_GRACE_S seconds to send their last chunk."""
        self.draining = True
        if self.calls and not self.ending_now:
            log.info("shutting down: %d requests in flight get up to %g s", len(self.calls), timeout)
        await self._wait_for_calls(timeout, until_ending_now=True)
        if self.calls and not self.ending_now:
            log.info("shutting down: aborting %d requests", len(self.calls))
            for call in list(self.calls):
                call.abort("shutdown")
        await self._wait_for_calls(ABORT_GRACE_S)

    def end_now(self) -> None:
        """Shut down at once: refuse new requests and end every call in flight now, as an abort at
        shutdown does (a stream's last chunk has ``finish_reason: "abort"``, then ``[DONE]``), without
        waiting for the engine to finish its step. A :meth:`drain` under way stops waiting."""
        self.draining = self.ending_now = True
        if self.calls:
            log.info("shutting down now: ending %d requests", len(self.calls))
        for call in list(self.calls):
            call.end_now()

    async def _wait_for_calls(self, seconds: float, until_ending_now: bool = False) -> None:
        deadline = time.monotonic() + seconds
        while self.calls and time.monotonic() < deadline and not (until_ending_now and self.ending_now):
            await asyncio.sleep(0.05)


async def _deltas(request: Request, call: "_Call", watch_disconnect: bool):
    """Each delta of the call's requests as it arrives, until all finished; aborts them at the
    call's deadline. Raises APIError(500) when the engine failed a request; with
    ``watch_disconnect`` ends quietly when the client went away. A choice's deltas after its last
    one are skipped (after :meth:`_Call.end_now`, the engine's own last delta comes too)."""
    done = set()  # the indices of the choices whose last delta came
    while len(done) < len(call.subs):
        wait = 1.0 if call.deadline is None or call.aborted else min(1.0, call.deadline - time.monotonic())
        try:
            delta = await asyncio.wait_for(call.queue.get(), timeout=max(wait, 0.0))
        except asyncio.TimeoutError:
            if call.deadline is not None and not call.aborted and time.monotonic() >= call.deadline:
                call.abort("request timeout")
            elif watch_disconnect and await request.is_disconnected():
                return
            continue
        if delta.index in done:
            continue
        sub = call.subs[delta.index]
        if sub.error is not None:
            raise APIError(500, sub.error, type="server_error")
        if delta.finished:
            done.add(delta.index)
        yield delta


# Characters JSON leaves raw (with ensure_ascii=False) that str.splitlines() and clients built on it
# (httpx's aiter_lines) take for line ends: escaped, so an event is one line for every client
_LINE_ENDS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False).translate(_LINE_ENDS)}\n\n"


def build_app(llm, loop: EngineLoop, model_name: str, api_key: str | None = None, max_queued: int | None = None,
              request_timeout: float | None = None) -> FastAPI:
    """The FastAPI app; the loop is started and stopped with the app's lifespan. ``max_queued``:
    a request arriving while this many wait gets 503; ``request_timeout``: seconds after which a
    request is aborted. ``await app.state.drain(timeout)`` shuts the app down gracefully (the
    server calls it on SIGTERM before stopping); ``app.state.end_now()`` (a second signal) ends
    every request at once."""
    server = _Server(llm, loop, model_name, max_queued, request_timeout)
    app = FastAPI(title="dsa", lifespan=_lifespan(loop, model_name))
    app.state.drain, app.state.end_now = server.drain, server.end_now
    for exc_class, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    keyed = [Depends(_authorizer(api_key))]

    @app.get("/health")
    async def health():
        if server.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "dsa", "max_model_len": server.limit}]}

    @app.get("/metrics")
    async def metrics():
        text = prometheus_text(loop.metrics()) + server.latency.text()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request):
        prompts, sampling = _completion_prompts(server, body)
        return await _respond(request, server, prompts, sampling, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(body: ChatRequest, request: Request):
        prompt, sampling = _chat_prompt(server, body)
        return await _respond(request, server, [prompt], sampling, body, chat=True)

    return app


def _lifespan(loop: EngineLoop, model_name: str):
    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        log.info("serving %s", model_name)
        try:
            yield
        finally:
            loop.stop()
    return lifespan


def _authorizer(api_key: str | None):
    """The ``/v1`` routes' dependency: 401 unless the request sends ``Authorization: Bearer <api_key>``
    (when a key is set)."""
    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    return authorize


async def _api_error(request, exc: APIError):
    return exc.response()


async def _invalid(request, exc: RequestValidationError):
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid" or not loc:  # unparsable, or not an object
        return APIError(400, f"malformed JSON: expected a JSON object ({err.get('msg', 'invalid')})").response()
    return APIError(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}", loc[0]).response()


async def _http_error(request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail),
                    type="not_found_error" if exc.status_code == 404 else "invalid_request_error").response()


async def _crash(request, exc: Exception):
    log.exception("request failed")
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


_ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _invalid, StarletteHTTPException: _http_error,
                   Exception: _crash}  # every error as OpenAI's error body


def _completion_prompts(server: _Server, body: CompletionRequest) -> tuple:
    """``(prompts, sampling)``: each prompt of the request (a string or token ids, or a list of
    them) as checked token ids, and its sampling."""
    server.check_open()
    server.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo: not supported", "echo")
    if body.max_tokens is None:
        raise APIError(400, "max_tokens: expected an int", "max_tokens")
    prompt = body.prompt
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    sampling = _sampling(body, body.max_tokens, body.logprobs, server.sampling_defaults)
    return [server.check(server.encode(p), sampling) for p in batch], sampling


def _chat_prompt(server: _Server, body: ChatRequest) -> tuple:
    """``(prompt, sampling)``: the messages through the tokenizer's chat template as checked token
    ids, and the sampling (without a max_tokens: CHAT_DEFAULT_MAX_TOKENS, or what the context leaves)."""
    server.check_open()
    server.check_model(body.model)
    if server.llm.tokenizer is None:
        raise APIError(400, "messages: this checkpoint has no tokenizer", "messages")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    try:
        ids = server.llm.chat_ids(messages)
    except (ChatTemplateError, ValueError) as e:
        raise APIError(400, str(e), "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(CHAT_DEFAULT_MAX_TOKENS, server.limit - len(ids)))
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
    sampling = _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                         server.sampling_defaults)
    return server.check(ids, sampling), sampling


def _message(m: ChatMessage, i: int) -> dict:
    out = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # content parts: text only
        texts = []
        for part in m.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    return out


def _logprobs_completion(server: _Server, lps: list, offset: int) -> dict:
    tokens = [server.token_text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{server.token_text(i): x for i, x in lp.top} for lp in lps], "text_offset": offsets}


def _logprobs_chat(server: _Server, lps: list) -> dict:
    def entry(i, x):
        return {"token": server.token_text(i), "logprob": x, "bytes": server.token_bytes(i)}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, x) for i, x in lp.top]}
                        for lp in lps]}


class _Call:
    """One HTTP request's submissions and what its response is built from. :meth:`close` (always
    called once, when the response ends or fails) aborts what is unfinished and logs its line."""

    def __init__(self, server: _Server, prompts: list, sampling: SamplingParams, body, chat: bool):
        self.server, self.sampling, self.chat = server, sampling, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.t0 = time.perf_counter()
        self.queue = asyncio.Queue()
        self.subs = [Submission(ids, sampling, self.queue, i) for i, ids in enumerate(prompts)]
        self.counts = [0] * len(self.subs)  # completion tokens per choice
        self.reasons = [None] * len(self.subs)  # finish reason per choice
        self.deadline = None  # time.monotonic() when it is aborted (request_timeout)
        self.aborted = None  # why the server aborted it: "request timeout", "shutdown"
        self.timers = [server.latency.timer(self.t0) for _ in self.subs]
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage
        self.base = {"id": self.id, "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": server.model_name}

    def timed(self, d) -> None:
        """Time a delta as the handler passes it on (the latency histograms)."""
        self.timers[d.index].token(d, self.subs[d.index].admitted)

    def usage(self) -> dict:
        prompt, done = sum(len(s.prompt_ids) for s in self.subs), sum(self.counts)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def logprobs(self, lps: list, offset: int = 0):
        if self.sampling.logprobs is None:
            return None
        return _logprobs_chat(self.server, lps) if self.chat else _logprobs_completion(self.server, lps, offset)

    def abort(self, why: str) -> None:
        if self.aborted is None:
            self.aborted = why
            self.server.abort_unfinished(self.subs)

    def end_now(self) -> None:
        """Abort it at shutdown, and give each unfinished choice its last delta ("abort") now; the
        engine's, which comes after its current step, is skipped (:func:`_deltas`)."""
        self.abort("shutdown")
        for s in self.subs:
            if not s.finished:
                self.queue.put_nowait(Delta(-1 if s.rid is None else s.rid, finish_reason="abort", index=s.index))

    def abort_error(self) -> APIError:
        if self.aborted == "request timeout":
            return APIError(504, f"the request did not finish within the server's request timeout "
                            f"({self.server.request_timeout:g} s) and was aborted", type="timeout_error")
        if self.aborted == "shutdown":
            return APIError(503, "the server is shutting down; the request was aborted", type="server_error")
        return APIError(500, "the request was aborted", type="server_error")

    def close(self) -> None:
        if self not in self.server.calls:
            return
        errors = [s.error for s in self.subs if s.error is not None]
        why = self.aborted or (errors[0] if errors else "client disconnected" if None in self.reasons else None)
        log.info("%s prompt_tokens=%d completion_tokens=%d time=%.2fs finish=%s%s", self.id,
                 self.usage()["prompt_tokens"], sum(self.counts), time.perf_counter() - self.t0,
                 ",".join(r or "abort" for r in self.reasons), f" ({why})" if why else "")
        self.server.calls.discard(self)
        self.server.abort_unfinished(self.subs)  # after the line: a reader of the log sees it once blocks are free


class _Stream(StreamingResponse):
    """A streamed response whose call is closed however the stream ends (also when it never starts)."""

    def __init__(self, request: Request, call: _Call):
        super().__init__(_events(request, call), media_type="text/event-stream")
        self.call = call

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.close()


async def _respond(request: Request, server: _Server, prompts: list, sampling: SamplingParams, body, chat: bool):
    call = _Call(server, prompts, sampling, body, chat)
    server.admit(call)
    if body.stream:
        return _Stream(request, call)
    texts, lps, reasons = [""] * len(prompts), [[] for _ in prompts], call.reasons
    try:
        async for d in _deltas(request, call, watch_disconnect=True):
            call.counts[d.index] += len(d.token_ids)
            call.timed(d)
            texts[d.index] += d.text or ""
            lps[d.index] += d.logprobs or []
            if d.finished:
                reasons[d.index] = d.finish_reason
    finally:
        call.close()
    if any(r is None for r in reasons):  # the client went away
        return Response(status_code=499)
    if "abort" in reasons:
        raise call.abort_error()
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": call.logprobs(lp),
                    "finish_reason": r} for i, (t, lp, r) in enumerate(zip(texts, lps, reasons))]
    else:
        choices = [{"index": i, "text": t, "logprobs": call.logprobs(lp), "finish_reason": r}
                   for i, (t, lp, r) in enumerate(zip(texts, lps, reasons))]
    return {**call.base, "choices": choices, "usage": call.usage()}


async def _events(request: Request, call: _Call):
    """The server-sent events of a streamed response, ending in ``data: [DONE]``."""
    chunk = {**call.base, "object": "chat.completion.chunk"} if call.chat else call.base
    offsets = [0] * len(call.subs)
    try:
        if call.chat:
            yield _sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        async for d in _deltas(request, call, watch_disconnect=False):
            call.counts[d.index] += len(d.token_ids)
            call.timed(d)
            reason = d.finish_reason
            if not d.text and reason is None and not d.logprobs:
                continue
            lp = call.logprobs(d.logprobs or [], offsets[d.index])
            offsets[d.index] += len(d.text or "")
            if call.chat:
                choice = {"index": d.index, "delta": {"content": d.text} if d.text else {}}
            else:
                choice = {"index": d.index, "text": d.text or ""}
            yield _sse({**chunk, "choices": [{**choice, "logprobs": lp, "finish_reason": reason}]})
            if reason is not None:
                call.reasons[d.index] = reason
        if call.include_usage:
            yield _sse({**chunk, "choices": [], "usage": call.usage()})
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield _sse(e.body())
        yield "data: [DONE]\n\n"
