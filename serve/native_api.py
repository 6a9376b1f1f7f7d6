"""SGLang's native `/generate`: text or input_ids in, SGLang-shaped results (streamed or not) out."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from serve import openai_protocol as P
from serve.io_struct import spec_meta
from serve.openai_api import Choice, _error_of, _merge, _sse, _started
from serve.tokenizer_manager import TokenizerManager


def _meta(c: Choice, rid: str, ret_logprob: bool, top: int, started: float) -> dict:
    meta = {"id": rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.ids),
            "cached_tokens": c.cached_tokens, "finish_reason": c.finish,
            "e2e_latency": time.perf_counter() - started, **spec_meta(*c.spec)}
    if ret_logprob:
        meta["input_token_logprobs"] = c.input_logprobs or []
        meta["output_token_logprobs"] = c.logprobs
        if top:
            meta["input_top_logprobs"] = c.input_tops or []
            meta["output_top_logprobs"] = c.tops
    return meta


async def generate_native(request: Request, req: P.GenerateRequest, tm: TokenizerManager, until_disconnected):
    single = req.batch_size is None
    if req.text is not None:
        if tm.tokenizer is None:
            raise P.ProtocolError("this server runs without a tokenizer: send input_ids", param="text")
        # On a worker thread: a long text takes seconds to tokenize, which must not stall the event loop.
        id_lists = await asyncio.to_thread(lambda: [tm.tokenizer.encode(t) for t in req.prompts])
    else:
        id_lists = req.prompts
    if req.rid is None:
        rids = [uuid.uuid4().hex for _ in id_lists]
    else:
        rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
    streams = []
    for rid, ids, params in zip(rids, id_lists, req.params_list(), strict=True):
        params["max_new_tokens"] = tm.check_prompt(ids, params.get("max_new_tokens", 128))
        streams.append(tm.generate(ids, params, return_logprob=req.return_logprob,
                                   logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                                   top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                                   rid=rid))
    started = time.perf_counter()
    choices = [Choice() for _ in streams]

    def result(i: int) -> dict:
        c = choices[i]
        return {"text": c.text, "output_ids": list(c.ids),
                "meta_info": _meta(c, rids[i], req.return_logprob, req.top_logprobs_num, started)}

    if req.stream:
        merged = await _started(streams)

        async def sse():
            try:
                async for i, out in merged:
                    choices[i].add(out)
                    item = result(i)
                    if not single:
                        item["index"] = i
                    yield _sse(item)
            except Exception as e:
                yield _sse(_error_of(e))
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def collect():
        async for i, out in _merge(streams):
            choices[i].add(out)

    await until_disconnected(request, asyncio.create_task(collect()))
    results = [result(i) for i in range(len(choices))]
    return JSONResponse(results[0] if single else results)
