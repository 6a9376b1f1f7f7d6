"""`serve.Engine`: the scheduler and runtime in-process, with SGLang's `generate` shape."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import numpy as np

from runtime.sampling_params import SamplingParams
from scheduler import Req
from scheduler.stop import trim_stop_string
from serve.server_args import ServerArgs
from serve.setup import build_core


class Engine:
    """Loads a model, sizes the pools, precompiles every bucket, then serves `generate`/`chat` calls.

    Keyword options are ServerArgs fields (the CLI flags in snake_case).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.args = ServerArgs(model=model, **kwargs)
        core = build_core(self.args)
        self.model_path = core.model_path
        self.tokenizer = core.tokenizer
        self.scheduler = core.scheduler
        self.runner = core.runner
        self.model_config = core.runner.model_cfg
        self.context_length = core.context_length
        self.startup_seconds = core.startup_seconds
        self.precompile_seconds = core.precompile_seconds
        self._rng = np.random.default_rng(self.args.random_seed)

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
        """SGLang's `Engine.generate`: one prompt (dict back) or a list (list back), text or token ids."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) if prompt is not None else bool(input_ids) and isinstance(input_ids[0], int)
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (started with skip_tokenizer_init): pass input_ids")
            prompts = [prompt] if single else list(prompt)
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(params_list) != len(ids_list):
            raise ValueError(f"{len(params_list)} sampling_params for {len(ids_list)} prompts")
        if top_logprobs_num > self.args.max_top_logprobs:
            raise ValueError(f"top_logprobs_num={top_logprobs_num} exceeds max_top_logprobs={self.args.max_top_logprobs}")
        reqs = [self._make_req(ids, p, return_logprob, logprob_start_len, top_logprobs_num)
                for ids, p in zip(ids_list, params_list)]
        for req in reqs:
            self.scheduler.validate(req)
        for req in reqs:
            self.scheduler.add_request(req)
        while not all(r.finished for r in reqs):
            self.scheduler.step()
        outs = [self._result(r) for r in reqs]
        return outs[0] if single else outs

    def chat(self, messages: list[dict], sampling_params: dict | None = None, **kwargs: Any) -> dict:
        """Applies the chat template to `messages` and generates one reply."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (started with skip_tokenizer_init)")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(input_ids=ids, sampling_params=sampling_params, **kwargs)

    def server_info(self) -> dict:
        s = self.scheduler
        return {
            "args": dataclasses.asdict(self.args),
            "model_path": self.model_path,
            "context_length": self.context_length,
            "max_total_tokens": s.capacity_tokens,
            "free_tokens": s.pages.num_free * s.page_size,
            "num_programs": len(self.runner.programs()),
            "compiles_after_warmup": self.runner.compiles_after_warmup,
            "startup_seconds": self.startup_seconds,
        }

    def shutdown(self) -> None:
        """Aborts what is still queued or running and drops device buffers."""
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(req.rid, "engine shut down")
        self.runner.pools = None
        self.runner.params = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers -----------------------------------------------------------------------------

    def _make_req(self, ids, params, return_logprob, logprob_start_len, top_logprobs_num) -> Req:
        p = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
        seed = p.seed if p.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        return Req(
            rid=uuid.uuid4().hex, prompt_ids=[int(t) for t in ids], params=p, seed=seed,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
        )

    def _result(self, req: Req) -> dict:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival_time,
        }
        if req.return_logprob:
            meta["input_token_logprobs"] = [req.input_token_logprobs[i] for i in sorted(req.input_token_logprobs)]
            meta["output_token_logprobs"] = list(req.output_token_logprobs)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = [req.input_top_logprobs[i] for i in sorted(req.input_top_logprobs)]
                meta["output_top_logprobs"] = list(req.output_top_logprobs)
        return {"text": trim_stop_string(text, req.finish_reason), "output_ids": list(req.output_ids),
                "meta_info": meta}
