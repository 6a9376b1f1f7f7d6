"""TokenizerManager (main process): sends tokenized requests to the scheduler and streams results back."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from serve.io_struct import AbortReq, BatchTokenOut, ControlReq, ControlResp, TokenizedGenerateReq, TokenOut
from serve.metrics import Metrics


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclasses.dataclass
class _ReqState:
    queue: asyncio.Queue
    created: float
    last_token_time: float | None = None
    finished: bool = False


class TokenizerManager:
    def __init__(self, tokenizer, server_info: dict, scheduler_addr: str, output_addr: str, random_seed=None):
        self.tokenizer = tokenizer
        self.info = server_info  # context_length, max_total_tokens, vocab_size, eos_token_ids
        self.ctx = zmq.asyncio.Context()
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.connect(scheduler_addr)
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(output_addr)
        self.states: dict[str, _ReqState] = {}
        self.controls: dict[str, asyncio.Future] = {}
        self.metrics = Metrics()
        self.draining = False
        self._rng = np.random.default_rng(random_seed)
        self._task: asyncio.Task | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self.states)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._dispatch_loop())

    async def _dispatch_loop(self) -> None:
        while True:
            msg = await self.recv.recv_pyobj()
            if isinstance(msg, BatchTokenOut):
                for out in msg.outs:
                    state = self.states.get(out.rid)
                    if state is not None:
                        state.queue.put_nowait(out)
            elif isinstance(msg, ControlResp):
                fut = self.controls.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.payload)

    async def control(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        req_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.controls[req_id] = fut
        await self.send.send_pyobj(ControlReq(kind, req_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.controls.pop(req_id, None)

    def check_prompt(self, input_ids: list[int], max_new_tokens: int | None) -> int:
        """Validates the length; returns max_new_tokens (defaulting to what the context leaves)."""
        ctx = self.info["context_length"]
        limit = min(ctx, self.info["max_total_tokens"])
        n = len(input_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this server's limit is {limit - 1} "
                               f"(context length {ctx})")
        if max_new_tokens is None:
            return limit - n
        if n + max_new_tokens > limit:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({max_new_tokens}) = {n + max_new_tokens} "
                               f"exceeds this server's limit of {limit} tokens")
        return max_new_tokens

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, return_logprob=False,
                       logprob_start_len=-1, top_logprobs_num=0, response_format=None,
                       rid: str | None = None) -> AsyncIterator[TokenOut]:
        """Yields TokenOut messages (with `text_delta`) until the one carrying `finish_reason`.

        If the consumer stops early (client disconnect, cancellation), the request is aborted and its
        pages return to the pool.
        """
        if self.draining:
            raise RequestError("server is shutting down", 503)
        params = dict(sampling_params)
        if params.get("seed") is None:
            params["seed"] = int(self._rng.integers(0, 2**31 - 1))
        rid = rid or uuid.uuid4().hex
        if rid in self.states:  # checked before the try: its cleanup must not touch the request in flight
            raise RequestError(f"request id {rid!r} is already in use by a request in flight", 400)
        state = _ReqState(asyncio.Queue(), time.perf_counter())
        self.states[rid] = state
        try:
            await self.send.send_pyobj(TokenizedGenerateReq(
                rid, list(input_ids), params, return_logprob, logprob_start_len, top_logprobs_num,
                response_format))
            while True:
                out: TokenOut = await state.queue.get()
                if out.error is not None:
                    state.finished = True
                    self.metrics.requests.labels(outcome="rejected").inc()
                    raise RequestError(out.error, out.error_status)
                self._observe(state, out)
                yield out
                if out.finish_reason is not None:
                    state.finished = True
                    return
        finally:
            self.states.pop(rid, None)
            if not state.finished:
                await self.send.send_pyobj(AbortReq(rid))
                self.metrics.requests.labels(outcome="client_abort").inc()

    async def abort(self, rid: str) -> bool:
        """Asks the scheduler to abort `rid` (its client then gets finish reason abort); False if no request
        with that id is in flight."""
        if rid not in self.states:
            return False
        await self.send.send_pyobj(AbortReq(rid))
        return True

    def _observe(self, state: _ReqState, out: TokenOut) -> None:
        now = time.perf_counter()
        if out.new_ids:
            if state.last_token_time is None:
                self.metrics.ttft.observe(now - state.created)
            else:
                gap = (now - state.last_token_time) / len(out.new_ids)
                for _ in out.new_ids:
                    self.metrics.itl.observe(gap)
            state.last_token_time = now
            self.metrics.generation_tokens.inc(len(out.new_ids))
        if out.finish_reason is not None:
            self.metrics.e2e.observe(now - state.created)
            self.metrics.prompt_tokens.inc(out.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(out.cached_tokens)
            self.metrics.spec_verify_steps.inc(out.spec_verify_ct)
            self.metrics.spec_draft_tokens.inc(out.spec_draft_tokens)
            self.metrics.spec_accepted_tokens.inc(out.spec_accepted_tokens)
            self.metrics.requests.labels(outcome=out.finish_reason.get("type", "unknown")).inc()
