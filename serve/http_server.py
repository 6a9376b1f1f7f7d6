"""The FastAPI app: OpenAI-compatible and SGLang-native endpoints, health, info, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve import openai_protocol as P
from serve.openai_api import OpenAIHandlers, _sse
from serve.server_args import ServerArgs
from serve.tokenizer_manager import RequestError, TokenizerManager

_OPEN_PATHS = {"/health", "/metrics"}


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status)


async def _until_disconnected(request: Request, task: asyncio.Task):
    """Awaits `task`, cancelling it (which aborts its engine requests) if the client goes away."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            break
    return await task


def build_app(args: ServerArgs, tm: TokenizerManager) -> FastAPI:
    app = FastAPI(title="xlaserve")
    served = args.served_model_name or args.model or "smollm2-135m-instruct"
    names = {served, args.model or "smollm2-135m-instruct", tm.info.get("model_path", "")}
    api = OpenAIHandlers(tm, names, served, args.max_top_logprobs)
    api_key = args.api_key or os.environ.get("XLASERVE_API_KEY")

    @app.on_event("startup")
    async def _start() -> None:
        tm.start()

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key and request.url.path not in _OPEN_PATHS:
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return _error(401, "Incorrect or missing API key (send 'Authorization: Bearer KEY')",
                              "authentication_error", code="invalid_api_key")
        if tm.draining and request.method == "POST":
            return _error(503, "server is shutting down", "server_error", code="shutting_down")
        try:
            return await call_next(request)
        except Exception as e:  # never let a handler bug take the connection down without an answer
            return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    async def _body(request: Request, model):
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise P.ProtocolError("the request body is not valid JSON")
        if not isinstance(raw, dict):
            raise P.ProtocolError("the request body must be a JSON object")
        return model.model_validate(raw)

    async def _run(request: Request, model, handle, stream_handle):
        try:
            req = await _body(request, model)
            if getattr(req, "stream", False):
                gen = await stream_handle(req)
                return StreamingResponse(gen, media_type="text/event-stream")
            task = asyncio.create_task(handle(req))
            result = await _until_disconnected(request, task)
            return JSONResponse(result)
        except pydantic.ValidationError as e:
            return JSONResponse(P.validation_error_to_body(e), status_code=400)
        except P.ProtocolError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except RequestError as e:
            return _error(e.status, e.message, "server_error" if e.status >= 500 else "invalid_request_error")
        except asyncio.CancelledError:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _run(request, P.ChatCompletionRequest, api.chat, api.chat_stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _run(request, P.CompletionRequest, api.completion, api.completion_stream)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "xlaserve", "max_model_len": tm.info["context_length"]}]}

    @app.get("/health")
    async def health():
        if tm.draining:
            return _error(503, "server is shutting down", "server_error")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        try:
            async for _ in tm.generate([tm.info["eos_token_ids"][0] if tm.info["eos_token_ids"] else 0],
                                       {"max_new_tokens": 1, "temperature": 0}):
                pass
        except RequestError as e:
            return _error(503, f"generation failed: {e.message}", "server_error")
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        info = await tm.control("server_info")
        args_dict = {k: v for k, v in vars(args).items() if k != "api_key"}
        return {**args_dict, **info, "served_model_name": served, "in_flight_requests": tm.num_in_flight}

    @app.post("/flush_cache")
    async def flush_cache():
        return await tm.control("flush_cache")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json()
        rid = body.get("rid") if isinstance(body, dict) else None
        if not rid:
            return _error(400, "give the request id as {\"rid\": ...}", param="rid")
        from serve.io_struct import AbortReq

        await tm.send.send_pyobj(AbortReq(rid))
        return {"success": True}

    @app.get("/metrics")
    async def metrics():
        tm.metrics.update_from_server_info(await tm.control("server_info"))
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(request: Request):
        from serve.native_api import generate_native

        try:
            req = await _body(request, P.GenerateRequest)
            return await generate_native(request, req, tm, args.max_top_logprobs, _until_disconnected)
        except pydantic.ValidationError as e:
            return JSONResponse(P.validation_error_to_body(e), status_code=400)
        except P.ProtocolError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except RequestError as e:
            return _error(e.status, e.message, "server_error" if e.status >= 500 else "invalid_request_error")

    return app
