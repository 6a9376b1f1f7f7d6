"""`serve.Engine`: the scheduler and runtime in-process, with SGLang's `generate` shape."""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref
from typing import Any

import numpy as np
import pydantic

from runtime.sampling_params import SamplingParams
from scheduler import Req
from scheduler.stop import trim_stop_string
from serve.io_struct import spec_meta
from serve.openai_protocol import GenerateRequest, Limits, validation_error_to_body
from serve.server_args import ServerArgs
from serve.setup import build_core


class Engine:
    """Loads a model, sizes the pools, precompiles every bucket, then serves `generate`/`chat` calls.

    Keyword options are ServerArgs fields (the CLI flags in snake_case). By default the scheduler and
    detokenizer run in their own processes over ZMQ, exactly as behind the HTTP server;
    `in_process=True` runs the scheduler in this process instead (its state is then inspectable as
    `engine.scheduler`, which tests use).
    """

    def __init__(self, model: str | None = None, *, in_process: bool = False, **kwargs: Any):
        self.args = ServerArgs(model=model, **kwargs)
        self._rng = np.random.default_rng(self.args.random_seed)
        if in_process:
            core = build_core(self.args)
            self.tokenizer = core.tokenizer
            self.scheduler = core.scheduler
            self.runner = core.runner
            self.model_config = core.runner.model_cfg
            self.context_length = core.context_length
            self.startup_seconds = core.startup_seconds
            self.precompile_seconds = core.precompile_seconds
            self._backend = _InProcess(core)
            vocab_size = core.runner.model_cfg.vocab_size
        else:
            start = time.perf_counter()
            self._backend = _Processes(self.args)
            self.tokenizer = self._backend.tokenizer
            self.context_length = self._backend.ready["context_length"]
            self.startup_seconds = time.perf_counter() - start
            vocab_size = self._backend.ready["vocab_size"]
        self._limits = Limits(vocab_size, self.args.max_logit_bias, self.args.max_top_logprobs)

    # ---- public API --------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> dict | list[dict]:
        """SGLang's `Engine.generate`: one prompt (dict back) or a list (list back), text or token ids.

        Raises ValueError for invalid parameters or a prompt that cannot fit; nothing is queued then.
        """
        if isinstance(sampling_params, SamplingParams):
            sampling_params = dataclasses.asdict(sampling_params)
        elif isinstance(sampling_params, list):
            sampling_params = [dataclasses.asdict(p) if isinstance(p, SamplingParams) else p
                               for p in sampling_params]
        body = {"text": prompt, "input_ids": _plain_ints(input_ids), "sampling_params": sampling_params,
                "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num}
        try:  # the same rules as the server's /generate
            req = GenerateRequest.model_validate({k: v for k, v in body.items() if v is not None},
                                                 context=self._limits)
        except pydantic.ValidationError as e:
            raise ValueError(validation_error_to_body(e)["error"]["message"]) from None
        if req.text is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (started with skip_tokenizer_init): "
                                 "pass input_ids")
            ids_list = [self.tokenizer.encode(p) for p in req.prompts]
        else:
            ids_list = req.prompts
        reqs = []
        for ids, params in zip(ids_list, req.params_list(), strict=True):
            p = SamplingParams.from_dict(params)
            if p.seed is None:
                p = dataclasses.replace(p, seed=int(self._rng.integers(0, 2**31 - 1)))
            reqs.append(Req(
                rid=uuid.uuid4().hex, prompt_ids=list(ids), params=p, seed=p.seed,
                return_logprob=return_logprob, logprob_start_len=logprob_start_len if return_logprob else -1,
                top_logprobs_num=top_logprobs_num if return_logprob else 0,
            ))
        outs = self._backend.run(reqs)
        return outs[0] if req.batch_size is None else outs

    def chat(self, messages: list[dict], sampling_params: dict | None = None, **kwargs: Any) -> dict:
        """Applies the chat template to `messages` and generates one reply."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (started with skip_tokenizer_init)")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(input_ids=ids, sampling_params=sampling_params, **kwargs)

    def server_info(self) -> dict:
        return {"args": dataclasses.asdict(self.args), **self._backend.server_info()}

    def shutdown(self) -> None:
        """Aborts what is still queued or running and releases the processes or device buffers."""
        self._backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _plain_ints(ids: Any) -> Any:
    """`input_ids` with NumPy integers (an array, or lists of them) as Python ints; anything else as given,
    for validation to judge."""
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if isinstance(ids, (list, tuple)):
        return [_plain_ints(x) if isinstance(x, (list, tuple, np.ndarray)) else
                int(x) if isinstance(x, np.integer) else x for x in ids]
    return ids


def _meta(req: Req) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
        **spec_meta(req.spec_verify_steps, req.spec_draft_tokens, req.spec_accepted_tokens),
        "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival_time,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = [req.input_token_logprobs[i] for i in sorted(req.input_token_logprobs)]
        meta["output_token_logprobs"] = list(req.output_token_logprobs)
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [req.input_top_logprobs[i] for i in sorted(req.input_top_logprobs)]
            meta["output_top_logprobs"] = list(req.output_top_logprobs)
    return meta


class _InProcess:
    def __init__(self, core):
        self.core = core
        self.scheduler = core.scheduler

    def run(self, reqs: list[Req]) -> list[dict]:
        for req in reqs:
            self.scheduler.validate(req)
        for req in reqs:
            self.scheduler.add_request(req)
        while not all(r.finished for r in reqs):
            self.scheduler.step()
        tok = self.core.tokenizer
        outs = []
        for req in reqs:
            text = (tok.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
                    if tok else "")
            outs.append({"text": trim_stop_string(text, req.finish_reason),
                         "output_ids": list(req.output_ids), "meta_info": _meta(req)})
        return outs

    def server_info(self) -> dict:
        return self.core.server_info()

    def shutdown(self) -> None:
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(req.rid, "engine shut down")
        self.core.runner.pools = None
        self.core.runner.params = None


class _Processes:
    """The scheduler and detokenizer processes of the server, driven synchronously over ZMQ.

    They are started as module entry points (serve/children.py), so this works from a script without a
    `__main__` guard, from stdin and in a REPL. A forgotten `shutdown()` is done at interpreter exit (or when
    the Engine is garbage-collected); the children would also exit on their own once this process is gone.
    """

    def __init__(self, args: ServerArgs):
        import zmq

        from serve.children import ChildProcesses
        from serve.setup import load_model_tokenizer_path

        self.children = ChildProcesses(args)
        self.ready = self.children.scheduler_ready
        self.ctx = zmq.Context()
        self.send = self.ctx.socket(zmq.PUSH)
        self.recv = self.ctx.socket(zmq.PULL)
        # Holds no reference to self, so an Engine that goes out of scope is collected and shut down too.
        self._finalizer = weakref.finalize(self, _Processes._stop, self.children, self.ctx, self.send,
                                           self.recv)
        self.send.connect(self.children.scheduler_addr)
        self.recv.bind(self.children.output_addr)
        try:
            _, self.tokenizer = load_model_tokenizer_path(args)
        except BaseException:
            self._finalizer()
            raise

    def _recv(self):
        while not self.recv.poll(1000):
            dead = self.children.dead()
            if dead is not None:
                raise RuntimeError(f"the {dead[0]} process died (exit code {dead[1]})")
        return self.recv.recv_pyobj()

    def run(self, reqs: list[Req]) -> list[dict]:
        from serve.io_struct import BatchTokenOut, TokenizedGenerateReq

        results = {r.rid: {"text": "", "output_ids": [], "meta_info": {}} for r in reqs}
        pending = set(results)
        for r in reqs:
            params = {k: v for k, v in dataclasses.asdict(r.params).items()}
            self.send.send_pyobj(TokenizedGenerateReq(r.rid, r.prompt_ids, params, r.return_logprob,
                                                      r.logprob_start_len, r.top_logprobs_num))
        errors = []
        while pending:
            msg = self._recv()
            if not isinstance(msg, BatchTokenOut):
                continue
            for out in msg.outs:
                if out.rid not in pending:
                    continue
                res = results[out.rid]
                if out.error is not None:
                    errors.append(out.error)
                    pending.discard(out.rid)
                    continue
                res["text"] += out.text_delta
                res["output_ids"] += out.new_ids
                meta = res["meta_info"]
                meta.update(id=out.rid, prompt_tokens=out.prompt_tokens,
                            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
                            finish_reason=out.finish_reason)
                if out.input_token_logprobs is not None:
                    meta["input_token_logprobs"] = out.input_token_logprobs
                    if out.input_top_logprobs is not None:
                        meta["input_top_logprobs"] = out.input_top_logprobs
                if out.new_token_logprobs:
                    meta.setdefault("output_token_logprobs", []).extend(out.new_token_logprobs)
                if out.new_top_logprobs:
                    meta.setdefault("output_top_logprobs", []).extend(out.new_top_logprobs)
                if out.finish_reason is not None:
                    pending.discard(out.rid)
        if errors:
            raise ValueError(errors[0])
        for r in reqs:
            meta = results[r.rid]["meta_info"]
            meta["e2e_latency"] = time.perf_counter() - r.arrival_time
            if r.return_logprob:
                meta.setdefault("output_token_logprobs", [])
                if r.wants_input_logprobs:
                    meta.setdefault("input_token_logprobs", [])
        return [results[r.rid] for r in reqs]

    def server_info(self) -> dict:
        from serve.io_struct import ControlReq, ControlResp

        req_id = uuid.uuid4().hex
        self.send.send_pyobj(ControlReq("server_info", req_id))
        while True:
            msg = self._recv()
            if isinstance(msg, ControlResp) and msg.req_id == req_id:
                return msg.payload

    def shutdown(self) -> None:
        self._finalizer()  # runs once; later calls do nothing

    @staticmethod
    def _stop(children, ctx, *sockets) -> None:
        children.terminate()
        for sock in sockets:
            sock.close(linger=0)  # never wait at exit for messages nobody will read
        ctx.term()
