"""From ServerArgs to a ready Scheduler: resolve the model, load it, size pools, precompile. Shared by
the in-process `Engine` and the scheduler process."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

from kernels import cpu as cpu_kernels
from kernels.backend import CPU_OPS, KernelBackends
from kernels.cpu import build as cpu_build
from models.loader import load_model
from models.quantization import quantization_report, stored_panel_counts
from models.weights.lazy import STATS as load_stats
from runtime import distributed
from runtime.buckets import Buckets
from runtime.compile_cache import enable_persistent_cache
from runtime.mesh import bytes_on_first_device, param_sharding, per_device_cache_spec
from runtime.pool_sizing import device_bytes_in_use, device_memory_bytes, plan_pools
from runtime.runner import ModelRunner, RunnerConfig
from scheduler import Scheduler, SchedulerConfig
from serve import native_kernels
from serve.model_source import resolve_model
from serve.server_args import ServerArgs
from serve.tokenizer import Tokenizer, load_tokenizer


def log(msg: str) -> None:
    print(f"[xlaserve] {msg}", file=sys.stderr, flush=True)


def pick_dtype(name: str):
    """`auto`: float32 on CPU (bf16 matmuls measured no faster there), bfloat16 on accelerators."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def matmul_precision(dtype) -> str | None:
    """"highest" for float32 on an accelerator, whose default runs float32 dots in TF32 (GPU) or bfloat16
    passes (TPU): `--dtype float32` means float32 arithmetic. None (the backend's default) otherwise."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 and jax.default_backend() != "cpu" else None


@dataclasses.dataclass
class Core:
    """Everything a serving loop needs, built once."""

    args: ServerArgs
    model_path: str
    tokenizer: Tokenizer | None
    scheduler: Scheduler
    context_length: int
    startup_seconds: float
    precompile_seconds: float

    @property
    def runner(self) -> ModelRunner:
        return self.scheduler.runner

    def server_info(self) -> dict:
        """Pool capacity and usage, queue sizes, compile counts, allocator integrity."""
        s = self.scheduler
        free_tokens = s.num_available_tokens  # cached pages no request holds are as good as free
        try:
            s.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"violated: {e}"
        return {
            "integrity": integrity,
            "device": f"{jax.default_backend()}:{jax.devices()[0].device_kind} x{jax.device_count()}",
            "model_path": self.model_path,
            "context_length": self.context_length,
            "max_total_tokens": s.capacity_tokens,
            "chunked_prefill_size": s.cfg.chunked_prefill_size,
            # the backend's default when the flag is not given
            **({"speculative_num_draft_tokens": s.cfg.speculative.num_draft_tokens}
               if s.cfg.speculative else {}),
            # Request slots of the recurrent-state pool (SSM / linear-attention models); 0 without one.
            "recurrent_state_slots": (s.dp_size * self.runner.cfg.max_running_requests
                                      if self.runner.pools.recurrent else 0),
            "dp_size": s.dp_size,
            "num_admitted_per_rank": list(s.num_admitted_per_rank),
            "free_tokens": free_tokens,
            "used_tokens": s.capacity_tokens - free_tokens,
            "num_running_requests": len(s.running),
            "num_waiting_requests": len(s.waiting),
            "num_finished_requests": s.num_finished,
            "num_retractions": s.num_retractions,
            "prefix_cache": s.prefix_cache_info(),
            "speculative": s.speculative_info(),
            "num_steps": s.num_steps,
            # of them, dispatched while the step before ran (the overlap schedule)
            "num_overlapped_steps": s.num_overlapped_steps,
            "num_programs": len(self.runner.programs()),
            "compiles_after_warmup": self.runner.compiles_after_warmup,
            "startup_seconds": self.startup_seconds,
            "precompile_seconds": self.precompile_seconds,
        }


def log_kernels(kernels: KernelBackends, mesh) -> None:
    """Logs which implementation each op runs. Where native CPU kernels are picked it builds them first (once
    per process, before the precompile uses them), and when they cannot run it names those ops' references
    as what runs and logs a WARNING with the reason and the cost."""
    description = kernels.describe()  # the pick: a native kernel that cannot run falls back to its reference
    # The runner runs references on a mesh: XLA cannot partition a custom call.
    sharded = mesh is not None and mesh.size > 1
    native_ops = [] if sharded else [op for op in CPU_OPS if kernels.choice(op)[0] == "native"]
    start = time.perf_counter()
    why_off = cpu_kernels.unavailable_reason() if native_ops else None
    build_seconds = time.perf_counter() - start
    if sharded or why_off:
        description = description.replace("=native", "=reference")
    elif build_seconds > 1:
        description += f" (native CPU kernels compiled in {build_seconds:.0f} s)"
    if native_ops and not why_off:
        amx_off = cpu_kernels.amx_reason()
        description += (", AMX tiles on (bf16 products of 16 rows and more)" if amx_off is None
                        else f", AMX off: {amx_off}")
    log(f"kernels: {description}")
    if why_off:
        ops = ", ".join(native_ops)
        log(f"WARNING: native CPU kernels are off: {why_off}. {ops}: {cpu_build.FALLBACK_COST}")


def load_model_tokenizer_path(args: ServerArgs) -> tuple[str, Tokenizer | None]:
    cache_dir = args.resolved_cache_dir()
    model_path = resolve_model(args.model, cache_dir)
    if args.skip_tokenizer_init:
        return model_path, None
    tok_path = resolve_model(args.tokenizer_path, cache_dir) if args.tokenizer_path else model_path
    tokenizer = load_tokenizer(tok_path, cache_dir)
    if args.chat_template:
        with open(os.path.expanduser(args.chat_template), encoding="utf-8") as f:
            tokenizer = dataclasses.replace(tokenizer, chat_template=f.read())
    return model_path, tokenizer


# Texts whose token ids a draft model's tokenizer must give as the model's does.
_TOKENIZER_PROBES = ("Hello, world! The quick brown fox jumps over 13 lazy dogs.",
                     "def f(x):\n    return x ** 2", "Ünïcödé — 日本語のテキスト 🙂")


def _stored_panels(args: ServerArgs) -> bool:
    """Whether the loader lays out grouped weights in stored panels for the native CPU kernel
    (models/quantization.py `to_stored_panels`): int8 activations, native products that read them, one device
    (`load_model` takes them only without sharding)."""
    return (args.activation_quantization == "int8" and args.parallel.num_devices == 1
            and KernelBackends.parse(args.kernel_backend).stored_panels())


def _load_draft_model(args: ServerArgs, cfg, tokenizer: Tokenizer | None, dtype, sharding):
    """(config, model) of the standalone drafter, (None, None) without one. Refuses a draft model that
    cannot serve as one: recurrent layers, a target without attention layers (whose pages the draft K/V
    shares), several nodes, or a tokenizer that encodes differently."""
    if args.speculative_algorithm is None or args.speculative_algorithm.lower() != "standalone":
        return None, None
    if args.nnodes > 1:
        raise ValueError("speculative_algorithm 'standalone' runs on one node only")
    if not cfg.cache_spec.has_kv:
        raise ValueError("speculative_algorithm 'standalone' needs a model with attention layers (the draft "
                         "model's K/V lives in the model's pages)")
    path = resolve_model(args.speculative_draft_model_path, args.resolved_cache_dir())
    draft_cfg, draft = load_model(path, dtype, quantization=args.quantization,
                                  activation_quantization=args.activation_quantization, sharding=sharding,
                                  layer_weights=args.layer_weights, stored_panels=_stored_panels(args))
    if draft_cfg.cache_spec.recurrent is not None:
        raise ValueError(f"draft model {path}: recurrent layers are not supported in a draft model (its "
                         "state would have to roll back to the accepted draft)")
    if tokenizer is not None and not args.skip_tokenizer_init:
        theirs = load_tokenizer(path, args.resolved_cache_dir())
        for text in _TOKENIZER_PROBES:
            if theirs.encode(text) != tokenizer.encode(text):
                raise ValueError(f"draft model {path}: its tokenizer encodes {text!r} differently from the "
                                 "model's; a draft model must share the model's tokenizer")
    log(f"draft model {path}: {sum(x.nbytes for x in jax.tree.leaves(draft)) / 2**20:.0f} MiB of weights, "
        f"vocabulary {draft_cfg.vocab_size} (the model's: {cfg.vocab_size})")
    return draft_cfg, draft


def build_core(args: ServerArgs) -> Core:
    """Loads, sizes and precompiles. With `nnodes > 1` this process first joins the multi-host program
    (`args.node_rank`); node 0 then waits for every follower (runtime/distributed.py) before returning."""
    start = time.perf_counter()
    # First: the kernels read their configuration at their first build, whatever triggers it.
    native_kernels.configure(args.resolved_cache_dir())
    if args.nnodes > 1:
        distributed.initialize(args.nnodes, args.node_rank, args.dist_init_addr)
        if args.parallel.num_devices != jax.device_count():
            raise ValueError(f"across {args.nnodes} nodes tp_size * dp_size = {args.parallel.num_devices} "
                             f"must equal the {jax.device_count()} devices of all nodes together")
        log(f"node {args.node_rank} of {args.nnodes}: {jax.local_device_count()} of {jax.device_count()} "
            "devices")
    model_path, tokenizer = load_model_tokenizer_path(args)
    enable_persistent_cache(args.resolved_compilation_cache_dir())
    dtype = pick_dtype(args.dtype)
    log(f"loading {model_path} ({jnp.dtype(dtype).name}, backend {jax.default_backend()})")
    mesh = args.parallel.make_mesh()
    sharding = functools.partial(param_sharding, mesh) if mesh is not None else None
    load_stats.clear()
    cfg, model = load_model(model_path, dtype, quantization=args.quantization,
                            activation_quantization=args.activation_quantization, sharding=sharding,
                            layer_weights=args.layer_weights, stored_panels=_stored_panels(args))
    log(f"read {load_stats.bytes_read() / 2**20:.2f} MiB of the checkpoint's "
        f"{load_stats.checkpoint_bytes / 2**20:.2f} MiB (as float32)"
        + (f"; each device's shards read on their own ({jax.process_count()} process(es))" if mesh else ""))
    if args.quantization not in (None, "none"):
        log(quantization_report(model, args.quantization, dtype).describe())
        panels, quantized = stored_panel_counts(model)
        if panels:
            log(f"stored panels: {panels} of {quantized} grouped weights laid out for the native int8 "
                "kernel (read in place, not repacked each call)")
    context_length = args.context_length or cfg.max_position_embeddings
    # The memory plan is per device: under tensor parallelism a device holds its shards of the weights, its
    # KV heads and (delta-rule layers) its recurrent-state heads (runtime/mesh.py).
    def device_bytes(tree) -> int:
        if mesh is None:
            return sum(x.nbytes for x in jax.tree.leaves(tree))
        return bytes_on_first_device(tree)

    weight_bytes = device_bytes(model)
    draft_cfg, draft_model = _load_draft_model(args, cfg, tokenizer, dtype, sharding)
    if draft_model is not None:
        weight_bytes += device_bytes(draft_model)
    frac = args.mem_fraction_static
    if frac is None:
        frac = 0.1 if jax.default_backend() == "cpu" else 0.85
    spec = cfg.cache_spec
    # Without attention layers pages only count tokens: one page per request keeps the page table at width 1
    # (a recurrent model's default context is unbounded, and 16-token pages would make it enormous).
    page_size = args.page_size if spec.has_kv else context_length
    kv_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    speculative = args.speculative_config(jax.default_backend())
    device_memory = device_memory_bytes()
    # What the process already holds on an accelerator besides these weights (another Engine in the same
    # process, a benchmark's baseline) is not this engine's to plan with: sized as if the device were its
    # own, the second engine's first step ran out of memory on a GPU. (CPU: no count, the host's RAM.)
    other_bytes = max(0, device_bytes_in_use() - weight_bytes)
    if jax.default_backend() == "cpu":  # CPU devices (fake ones, for testing) share the host's memory
        device_memory //= args.parallel.num_devices
    plan = plan_pools(
        per_device_cache_spec(mesh, spec), dtype, kv_dtype=kv_dtype, page_size=page_size,
        weight_bytes=weight_bytes, device_memory=device_memory, other_bytes=other_bytes,
        mem_fraction_static=frac,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
        max_pages_per_request=-(-context_length // page_size), max_recurrent_slots=args.max_recurrent_slots,
        recurrent_state_memory_ratio=args.recurrent_state_memory_ratio,
        state_snapshots=not args.disable_radix_cache, max_state_snapshots=args.max_state_snapshots,
        draft_tokens=speculative.num_draft_tokens if speculative else 0,
        draft_kv_bytes_per_token=(per_device_cache_spec(mesh, draft_cfg.cache_spec).kv_bytes_per_token(
            kv_dtype or dtype) if draft_cfg else 0),
    )
    max_running = plan.max_running_requests
    prefill_chunk = args.prefill_chunk(jax.default_backend())
    buckets = Buckets.make(
        max_running_requests=max_running, chunked_prefill_size=prefill_chunk,
        prefill_block_size=args.prefill_block_size, max_context_len=context_length, page_size=page_size,
    )
    runner_cfg = RunnerConfig(
        page_size=page_size, num_pages=plan.num_pages, max_running_requests=max_running,
        buckets=buckets, vocab_size=cfg.vocab_size, max_top_logprobs=args.max_top_logprobs,
        max_bias=args.max_logit_bias,
        multi_step_decode=args.num_continuous_decode_steps, kernels=KernelBackends.parse(args.kernel_backend),
        dp_size=args.dp_size, matmul_precision=matmul_precision(dtype), state_snapshots=plan.state_snapshots,
        kv_cache_dtype=kv_dtype, draft_state_slots=plan.draft_state_slots,
        max_draft_tokens=speculative.num_draft_tokens if speculative else 0,
    )
    runner = ModelRunner(model, cfg, runner_cfg, dtype, mesh=mesh)
    del model
    draft_runner = None
    if draft_model is not None:  # its K/V in pages of the same ids as the model's (scheduler/draft_model.py)
        draft_runner = ModelRunner(draft_model, draft_cfg, dataclasses.replace(
            runner_cfg, vocab_size=draft_cfg.vocab_size, max_top_logprobs=1, max_bias=1, multi_step_decode=1,
            state_snapshots=0, draft_state_slots=0, max_draft_tokens=0), dtype, mesh=mesh)
        del draft_model
    if mesh is not None:
        log(f"mesh {dict(mesh.shape)} over {mesh.devices.size} devices; per device: weights "
            f"{bytes_on_first_device(runner.params) / 2**20:.1f} MiB, "
            f"pools {bytes_on_first_device(runner.pools) / 2**20:.1f} MiB")
    per_rank = f" per data-parallel rank (x{args.dp_size})" if args.dp_size > 1 else ""
    kv_note = f"; KV cache in {kv_dtype}" if kv_dtype and jnp.dtype(kv_dtype) != jnp.dtype(dtype) else ""
    per_device = " per device" if mesh is not None else ""
    log(f"weights {weight_bytes / 2**20:.0f} MiB{per_device}; {plan.describe(spec, page_size)}{per_rank}"
        f"{per_device}{kv_note}; "
        f"context {context_length}; {len(runner.programs())} step programs")
    log_kernels(runner_cfg.kernels, mesh)
    precompile_seconds = runner.precompile()
    if draft_runner is not None:
        log(f"draft model {args.speculative_draft_model_path}: {len(draft_runner.programs())} step programs")
        precompile_seconds += draft_runner.precompile()
    if args.nnodes > 1 and args.node_rank == 0:
        broadcaster = distributed.StepBroadcaster(args.dist_init_addr, args.nnodes - 1)
        try:
            broadcaster.wait_for_followers(repr(runner_cfg), timeout=300)
        except BaseException:
            broadcaster.close()
            raise
        runner.on_step = broadcaster
        log(f"{args.nnodes - 1} follower node(s) ready")
    eos = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    scheduler = Scheduler(
        runner,
        SchedulerConfig(
            max_running_requests=max_running, chunked_prefill_size=prefill_chunk,
            max_context_len=context_length, max_queued_requests=args.max_queued_requests,
            num_continuous_decode_steps=args.num_continuous_decode_steps,
            overlap_schedule=not args.disable_overlap_schedule,
            load_balance_method=args.load_balance_method, schedule_policy=args.schedule_policy,
            prefix_cache=not args.disable_radix_cache,
            recurrent_page_size=args.page_size, speculative=speculative,
        ),
        eos_ids=frozenset(eos),
        decode=(lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None,
        draft_runner=draft_runner,
    )
    off = scheduler.prefix_cache_off_reason
    unit = scheduler.rank_caches[0].page_size if off is None else 0
    log(f"prefix cache: radix tree over {unit}-token pages"
        + (f", recurrent state snapshots every {unit} tokens" if scheduler.snapshot_unit else "")
        if off is None else f"prefix cache: off ({off})")
    spec = scheduler.cfg.speculative
    if spec is not None:
        off = scheduler.speculative_off_reason
        log(f"speculative decoding: {spec.algorithm}, up to {spec.num_draft_tokens} draft tokens per request "
            f"and step (suffixes of {spec.min_match}-{spec.max_match} tokens), while the step's "
            f"{scheduler.runner.cfg.buckets.max_decode} decode rows have room"
            + (f" and {runner_cfg.draft_state_slots} draft rows per step (recurrent state scratch slots)"
               if runner_cfg.draft_state_slots else "")
            + ("; as many as the measured step times say pay" if spec.adaptive else "")
            if off is None else f"speculative decoding: off ({off})")
    startup = time.perf_counter() - start
    log(f"ready in {startup:.1f} s (precompile {precompile_seconds:.1f} s)")
    return Core(args, model_path, tokenizer, scheduler, context_length, startup, precompile_seconds)
