"""`serve.Engine`: the scheduler and runtime in-process, with SGLang's `generate` shape."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.loader import load_model
from runtime.buckets import Buckets
from runtime.compile_cache import enable_persistent_cache
from runtime.pool_sizing import num_kv_pages
from runtime.runner import ModelRunner, RunnerConfig
from runtime.sampling_params import SamplingParams
from scheduler import Req, Scheduler, SchedulerConfig
from scheduler.stop import trim_stop_string
from serve.model_source import resolve_model
from serve.server_args import ServerArgs
from serve.tokenizer import load_tokenizer


def _log(msg: str) -> None:
    print(f"[xlaserve] {msg}", file=sys.stderr, flush=True)


def pick_dtype(name: str):
    """`auto`: float32 on CPU (bf16 matmuls measured no faster there), bfloat16 on accelerators."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


class Engine:
    """Loads a model, sizes the pools, precompiles every bucket, then serves `generate`/`chat` calls.

    Keyword options are ServerArgs fields (the CLI flags in snake_case).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.args = ServerArgs(model=model, **kwargs)
        start = time.perf_counter()
        cache_dir = self.args.resolved_cache_dir()
        self.model_path = resolve_model(self.args.model, cache_dir)
        enable_persistent_cache(self.args.resolved_compilation_cache_dir())
        self.tokenizer = None
        if not self.args.skip_tokenizer_init:
            tok_path = resolve_model(self.args.tokenizer_path, cache_dir) if self.args.tokenizer_path else self.model_path
            self.tokenizer = load_tokenizer(tok_path, cache_dir)
        dtype = pick_dtype(self.args.dtype)
        _log(f"loading {self.model_path} ({jnp.dtype(dtype).name}, backend {jax.default_backend()})")
        self.model_config, model = load_model(self.model_path, dtype)
        cfg = self.model_config
        self.context_length = self.args.context_length or cfg.max_position_embeddings
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model))
        frac = self.args.mem_fraction_static
        if frac is None:
            frac = 0.1 if jax.default_backend() == "cpu" else 0.85
        num_pages = num_kv_pages(
            num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
            page_size=self.args.page_size, weight_bytes=weight_bytes, mem_fraction_static=frac,
            max_total_tokens=self.args.max_total_tokens,
        )
        buckets = Buckets.make(
            max_running_requests=self.args.max_running_requests, chunked_prefill_size=self.args.chunked_prefill_size,
            prefill_block_size=self.args.prefill_block_size, max_context_len=self.context_length,
            page_size=self.args.page_size,
        )
        runner_cfg = RunnerConfig(
            page_size=self.args.page_size, num_pages=num_pages, max_running_requests=self.args.max_running_requests,
            buckets=buckets, max_top_logprobs=self.args.max_top_logprobs, max_bias=self.args.max_logit_bias,
            multi_step_decode=self.args.num_continuous_decode_steps,
        )
        self.runner = ModelRunner(model, cfg, runner_cfg, dtype)
        del model
        _log(f"weights {weight_bytes / 2**20:.0f} MiB; KV pool {num_pages - 1} pages x {self.args.page_size} = "
             f"{(num_pages - 1) * self.args.page_size} tokens ({self.runner.pools.kv.k.nbytes * 2 / 2**20:.0f} MiB); "
             f"context {self.context_length}; {len(self.runner.programs())} step programs")
        self.precompile_seconds = self.runner.precompile()
        eos = set(cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.scheduler = Scheduler(
            self.runner,
            SchedulerConfig(
                max_running_requests=self.args.max_running_requests,
                chunked_prefill_size=self.args.chunked_prefill_size, max_context_len=self.context_length,
                max_queued_requests=self.args.max_queued_requests,
                num_continuous_decode_steps=self.args.num_continuous_decode_steps,
            ),
            eos_ids=frozenset(eos),
            decode=(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)) if self.tokenizer else None,
        )
        self._rng = np.random.default_rng(self.args.random_seed)
        self._ids = itertools.count()
        self.startup_seconds = time.perf_counter() - start
        _log(f"ready in {self.startup_seconds:.1f} s (precompile {self.precompile_seconds:.1f} s)")

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
