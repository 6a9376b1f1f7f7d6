"""One static batch on the ModelRunner (no scheduler): prefill and greedy decode latency vs the roofline."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np

from bench.roofline import Roofline, cost_of, measure_roofline
from kernels.backend import KernelBackends
from memory import PageAllocator, ReqToTokenPool, kv_pool_bytes_per_token
from models.config import ModelConfig
from models.loader import load_model
from models.quantization import ACTIVATION_QUANTIZATION_CHOICES, QUANTIZATION_CHOICES
from runtime.batch_builder import SeqWork, build_step_batch
from runtime.buckets import Buckets, StepShape
from runtime.runner import ModelRunner, RunnerConfig
from runtime.sampling_params import SamplingParams
from serve import native_kernels
from serve.model_source import resolve_model
from serve.server_args import ServerArgs
from serve.setup import matmul_precision, pick_dtype

GREEDY = SamplingParams(temperature=0)


def forward_flops(cfg: ModelConfig, num_tokens: int, num_logit_rows: int, num_attended: int) -> int:
    """Useful FLOPs of one forward: 2 per weight per token, the LM head only on sampled rows, and attention.

    `num_attended` sums, over every query token, the keys it attends to (QK^T and PV: 4 FLOPs per key per
    head dimension). Padding is not counted. ModelConfig.num_params counts a tied embedding once; the
    embedding lookup is a gather (no FLOPs), so the vocab matrix is charged once, as the LM head.
    """
    head = cfg.vocab_size * cfg.hidden_size
    body = cfg.num_params - head * (1 if cfg.tie_word_embeddings else 2)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * num_attended
    return 2 * body * num_tokens + 2 * head * num_logit_rows + attention


def prefill_plan(
    rows: list[int], prompts: np.ndarray, buckets: Buckets, chunk_tokens: int
) -> list[list[SeqWork]]:
    """Splits the prompts into steps of at most `chunk_tokens` block-padded tokens, as the scheduler does."""
    bs = buckets.prefill_block_size
    blocks_per_step = min(chunk_tokens // bs, buckets.max_prefill_blocks)
    input_len = prompts.shape[1]
    steps, i, pos = [], 0, 0
    while i < len(rows):
        works, blocks_left = [], blocks_per_step
        while i < len(rows) and blocks_left > 0:
            n = min(input_len - pos, blocks_left * bs)
            works.append(
                SeqWork(
                    rows[i],
                    prompts[i, pos : pos + n],
                    pos,
                    False,
                    GREEDY,
                    seed=i,
                    reset_penalties=pos == 0,
                    num_prompt_tokens=input_len,
                )
            )
            blocks_left -= -(-n // bs)
            pos += n
            if pos == input_len:
                i, pos = i + 1, 0
        steps.append(works)
    return steps


def decode_works(rows: list[int], tokens: np.ndarray, pos: int, input_len: int) -> list[SeqWork]:
    return [
        SeqWork(r, tokens[i : i + 1], pos, True, GREEDY, seed=i, num_prompt_tokens=input_len)
        for i, r in enumerate(rows)
    ]


def run_batch(runner: ModelRunner, cfg: ModelConfig, args, batch: int, warmup: bool) -> dict:
    """Prefills `batch` random prompts and decodes `output_len` greedy tokens; returns timings.

    With `warmup`, only compiles and runs (on all-padding batches) each step shape the timed run will use.
    """
    rc = runner.cfg
    table = ReqToTokenPool(
        rc.max_running_requests, rc.buckets.max_pages, PageAllocator(rc.num_pages), rc.page_size
    )
    rows = [table.allocate_row() for _ in range(batch)]
    for r in rows:
        if not table.reserve(r, args.input_len + args.output_len):
            raise RuntimeError("KV pool too small for the batch")  # sized in main, so a bug
    prompts = np.random.default_rng(args.seed + batch).integers(
        0, cfg.vocab_size, (batch, args.input_len), dtype=np.int32
    )
    plan = prefill_plan(rows, prompts, rc.buckets, args.chunked_prefill_size)

    def build(works):
        return build_step_batch(works, rc, table.table, False)

    if warmup:
        zeros = np.zeros(batch, np.int32)
        shapes = {build(w)[1].shape for w in plan}
        shapes |= {
            build(decode_works(rows, zeros, args.input_len + s, args.input_len))[1].shape
            for s in range(args.output_len)
        }
        for shape in sorted(shapes):
            jax.block_until_ready(runner.step(runner.dummy_batch(shape), shape))
        return {}

    start = time.perf_counter()
    outs = []
    for works in plan:
        step_batch, layout = build(works)
        outs.append((works, layout, runner.step(step_batch, layout.shape)))
    jax.block_until_ready([o for _, _, o in outs])
    prefill_s = time.perf_counter() - start
    first = {}
    for works, layout, out in outs:
        ids = np.asarray(out.next_ids)
        for w, seq_row in zip(works, layout.seq_rows):
            if w.start_pos + len(w.token_ids) == args.input_len:
                first[w.row] = ids[seq_row]
    tokens = np.array([first[r] for r in rows], np.int32)

    first_tokens = tokens
    step_s, host_s, shapes, sync_ids = [], [], [], []
    for s in range(args.output_len):
        t0 = time.perf_counter()
        step_batch, layout = build(decode_works(rows, tokens, args.input_len + s, args.input_len))
        t1 = time.perf_counter()
        out = jax.block_until_ready(runner.step(step_batch, layout.shape))
        tokens = np.asarray(out.next_ids)[layout.seq_rows]
        step_s.append(time.perf_counter() - t0)
        host_s.append(t1 - t0)
        shapes.append(layout.shape)
        sync_ids.append(tokens)
    # The same decode again as the server's overlap schedule runs it (scheduler/stepping.py): each step built
    # and dispatched before the previous step's tokens are read back, fed the placeholder -1 - row for the
    # token still in flight (the program takes the row's last sampled token from the pools, runtime/step.py).
    # It rewrites the same K/V, and must sample the same tokens. A step's time: from one readback to the next.
    placeholders = np.asarray([-1 - r for r in rows], np.int32)
    overlap_s, overlap_ids, inflight = [], [], None
    last = time.perf_counter()
    for s in range(args.output_len + 1):
        out = None
        if s < args.output_len:
            feed = first_tokens if s == 0 else placeholders
            step_batch, layout = build(decode_works(rows, feed, args.input_len + s, args.input_len))
            out = (runner.step(step_batch, layout.shape), layout)
        if inflight is not None:
            overlap_ids.append(np.asarray(inflight[0].next_ids)[inflight[1].seq_rows])
            now = time.perf_counter()
            overlap_s.append(now - last)
            last = now
        inflight = out
    if not all(np.array_equal(a, b) for a, b in zip(sync_ids, overlap_ids, strict=True)):
        raise RuntimeError("overlapped decode steps sampled other tokens than synchronous ones")
    table.check_integrity()
    return {
        "prefill_s": prefill_s,
        "prefill_steps": len(plan),
        "prefill_logit_rows": sum(map(len, plan)),
        "step_s": step_s,
        "host_s": host_s,
        "overlap_step_s": overlap_s,
        "decode_shapes": shapes,
    }


def report(cfg: ModelConfig, runner: ModelRunner, roof: Roofline, args, batch: int, r: dict) -> dict:
    kv_dtype = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else roof.dtype
    kv_per_token = kv_pool_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    # An untied input embedding is only gathered (a few rows), not streamed; a tied one is read whole
    # as the head.
    weights_read = runner.weight_bytes - (0 if cfg.tie_word_embeddings else args.embed_bytes)
    n = args.input_len
    prefill_flops = forward_flops(cfg, batch * n, r["prefill_logit_rows"], batch * n * (n + 1) // 2)
    read_bytes, padded_bytes, bw_util, flop_util, roof_x, overlap_roof_x = [], [], [], [], [], []
    for s, (t, t_overlap, shape) in enumerate(zip(r["step_s"], r["overlap_step_s"], r["decode_shapes"])):
        context = n + s + 1  # tokens each sequence attends to, the one fed this step included
        nbytes = weights_read + kv_per_token * context * batch
        read_bytes.append(nbytes)
        padded_bytes.append(weights_read + kv_per_token * shape.pages * runner.cfg.page_size * shape.decode)
        bw_util.append(nbytes / t / roof.bandwidth_bytes_per_s)
        roof_x.append(t / (nbytes / roof.bandwidth_bytes_per_s))
        overlap_roof_x.append(t_overlap / (nbytes / roof.bandwidth_bytes_per_s))
        flop_util.append(forward_flops(cfg, batch, batch, batch * context) / t / roof.matmul_flops_per_s)
    med = statistics.median
    step = med(r["step_s"])
    return {
        "batch": batch,
        "input_len": n,
        "output_len": args.output_len,
        "device": roof.device,
        "dtype": roof.dtype,
        "decode_shape": list(r["decode_shapes"][-1]),
        "decode_slots": r["decode_shapes"][-1].decode,
        "prefill_steps": r["prefill_steps"],
        "prefill_s": r["prefill_s"],
        "prefill_tok_s": batch * n / r["prefill_s"],
        "prefill_flop_util": prefill_flops / r["prefill_s"] / roof.matmul_flops_per_s,
        "decode_step_ms_median": step * 1e3,
        "decode_step_ms_min": min(r["step_s"]) * 1e3,
        "decode_step_ms_max": max(r["step_s"]) * 1e3,
        "decode_host_ms_median": med(r["host_s"]) * 1e3,
        "decode_tok_s": batch / step,
        "decode_bytes_median": med(read_bytes),
        "decode_padded_bytes_median": med(padded_bytes),
        "decode_bw_util": med(bw_util),
        "decode_x_bw_roofline": med(roof_x),
        "overlap_step_ms_median": med(r["overlap_step_s"]) * 1e3,
        "overlap_tok_s": batch / med(r["overlap_step_s"]),
        "overlap_x_bw_roofline": med(overlap_roof_x),
        "decode_flop_util": med(flop_util),
        "bandwidth_gb_s": roof.bandwidth_bytes_per_s / 1e9,
        "matmul_gflop_s": roof.matmul_flops_per_s / 1e9,
    }


def xla_cross_check(runner: ModelRunner, cfg: ModelConfig, res: dict) -> None:
    """XLA's cost_analysis of the compiled decode step next to our count of the same padded shape.

    XLA counts a while loop's body once, so the layer scan shows up as one layer, and it counts both
    branches of the prompt-logprob `lax.cond` (an LM head over every token) though decode skips it. The
    'XLA's way' figure applies both rules to our count; its bytes are not comparable (weights stacked
    for the scan are read through a loop XLA does not unroll).
    """
    shape = StepShape(*res["decode_shape"])
    args = (runner.params, runner.pools, runner.dummy_batch(shape))
    cost = cost_of(runner._step_jit, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args))
    d, attended = shape.decode, shape.decode * shape.pages * runner.cfg.page_size
    ours = forward_flops(cfg, d, d, attended)
    xla_way = forward_flops(dataclasses.replace(cfg, num_layers=1), d, 2 * d, attended)

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x / 1e9:.3f} G"

    print(
        f"XLA cost_analysis of the decode step {tuple(shape)}: flops {fmt(cost['flops'])} "
        f"(ours counted XLA's "
        f"way {xla_way / 1e9:.3f} G, ours {ours / 1e9:.3f} G), bytes {fmt(cost['bytes_accessed'])} (ours "
        f"{res['decode_padded_bytes_median'] / 1e9:.3f} G at the padded page width)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32, help="decode steps after the prefill")
    p.add_argument("--model", default=None, help="path or alias (default: the server's default model)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="as the server's flag")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512, help="prefill tokens per step at most")
    p.add_argument("--prefill-block-size", type=int, default=16)
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="bucket page widths for this (default: input + output)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--activation-quantization", default="none", choices=ACTIVATION_QUANTIZATION_CHOICES,
                   help="as the server's flag")
    p.add_argument("--quantization", default=None, choices=[c for c in QUANTIZATION_CHOICES if c],
                   help="as the server's flag (e.g. auto: the GGUF file's own 4-/8-bit blocks)")
    p.add_argument("--kernel-backend", default="auto",
                   help="as the server's flag: auto, reference, pallas, and op=backend overrides "
                        "(e.g. auto,decode_attention=reference)")
    p.add_argument("--output-file", default=None, help="append one JSON line per batch size")
    args = p.parse_args(argv)
    # The native CPU kernels take CXX, XLASERVE_CPU_KERNELS, ... as the server does (serve/native_kernels.py).
    native_kernels.configure(ServerArgs().resolved_cache_dir())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(batch_sizes) < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError(f"{batch_sizes=}, {args.input_len=}, {args.output_len=} must all be >= 1")
    dtype = pick_dtype(args.dtype)

    before = measure_roofline(dtype)
    print(
        f"device {before.device}, dtype {before.dtype}, jax {jax.__version__}; roofline before: "
        f"read {before.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
        f"matmul {before.matmul_flops_per_s / 1e9:.1f} GFLOP/s"
    )
    path = resolve_model(args.model, ServerArgs().resolved_cache_dir())
    cfg, model = load_model(path, dtype, quantization=args.quantization,
                            activation_quantization=args.activation_quantization,
                            stored_panels=KernelBackends.parse(args.kernel_backend).stored_panels())
    args.embed_bytes = sum(getattr(model, n)[...].nbytes for n in ("embed", "embed_scale", "embed_zero")
                           if getattr(model, n, None) is not None)
    context = args.input_len + args.output_len
    if args.context_length is not None and args.context_length < context:
        raise ValueError(f"{args.context_length=} must hold input + output = {context} tokens")
    buckets = Buckets.make(
        max_running_requests=max(batch_sizes),
        chunked_prefill_size=args.chunked_prefill_size,
        prefill_block_size=args.prefill_block_size,
        max_context_len=args.context_length or context,
        page_size=args.page_size,
    )
    num_pages = max(batch_sizes) * -(-context // args.page_size) + 1
    runner = ModelRunner(
        model, cfg, RunnerConfig(args.page_size, num_pages, max(batch_sizes), buckets, cfg.vocab_size,
                                 kernels=KernelBackends.parse(args.kernel_backend),
                                 matmul_precision=matmul_precision(dtype),
                                 kv_cache_dtype=None if args.kv_cache_dtype == "auto"
                                 else args.kv_cache_dtype),
        dtype
    )
    del model
    print(
        f"model {path}: {cfg.num_params / 1e6:.1f} M params, weights {runner.weight_bytes / 2**20:.0f} MiB; "
        f"input {args.input_len}, output {args.output_len}, seed {args.seed}, "
        f"quantization {args.quantization or 'none'}, activations {args.activation_quantization}, "
        f"KV cache {args.kv_cache_dtype}"
    )

    start = time.perf_counter()
    for b in batch_sizes:
        run_batch(runner, cfg, args, b, warmup=True)
    runner.warmed_up = True  # any compile from here on is counted in compiles_after_warmup
    print(f"warm-up (compile + one run of each step shape used): {time.perf_counter() - start:.1f} s")

    runs = {b: run_batch(runner, cfg, args, b, warmup=False) for b in batch_sizes}
    after = measure_roofline(dtype)
    # The best of the two: on a shared machine a contended measurement would flatter the utilisation.
    roof = before._replace(
        bandwidth_bytes_per_s=max(before.bandwidth_bytes_per_s, after.bandwidth_bytes_per_s),
        matmul_flops_per_s=max(before.matmul_flops_per_s, after.matmul_flops_per_s),
    )
    print(
        f"roofline after: read {after.bandwidth_bytes_per_s / 1e9:.1f} GB/s, matmul "
        f"{after.matmul_flops_per_s / 1e9:.1f} GFLOP/s; utilisation below is against the better of the two"
    )
    results = []
    for b in batch_sizes:
        res = report(cfg, runner, roof, args, b, runs[b])
        results.append(res)
        if args.output_file:
            with open(args.output_file, "a") as f:
                f.write(json.dumps(res) + "\n")

    print(
        f"\n{'batch':>5} {'slots':>5} | {'prefill s':>9} {'tok/s':>8} {'FLOP%':>6} | {'step ms':>8} "
        f"{'min-max ms':>13} {'host ms':>7} {'tok/s':>8} {'BW%':>6} {'x roof':>6} {'FLOP%':>6} "
        f"{'MB read':>8} {'padded':>8} | {'overlap ms':>10} {'tok/s':>8} {'x roof':>6}"
    )
    for r in results:
        print(
            f"{r['batch']:>5} {r['decode_slots']:>5} | {r['prefill_s']:>9.3f} {r['prefill_tok_s']:>8.0f} "
            f"{100 * r['prefill_flop_util']:>5.1f}% | {r['decode_step_ms_median']:>8.2f} "
            f"{r['decode_step_ms_min']:>6.1f}-{r['decode_step_ms_max']:<6.1f} "
            f"{r['decode_host_ms_median']:>7.2f} "
            f"{r['decode_tok_s']:>8.1f} {100 * r['decode_bw_util']:>5.1f}% {r['decode_x_bw_roofline']:>6.2f} "
            f"{100 * r['decode_flop_util']:>5.1f}% {r['decode_bytes_median'] / 1e6:>8.1f} "
            f"{r['decode_padded_bytes_median'] / 1e6:>8.1f} | {r['overlap_step_ms_median']:>10.2f} "
            f"{r['overlap_tok_s']:>8.1f} {r['overlap_x_bw_roofline']:>6.2f}"
        )
    print(
        "slots: decode rows after bucket padding; step ms: median decode step (host batch build + device + "
        "token readback), host ms: its batch build; BW%/FLOP%: of the roofline above; x roof: step time / "
        "(bytes read / bandwidth); MB read: weights + KV actually attended, "
        "padded: KV at the page-table width; overlap: the same steps as the server's overlap schedule runs "
        "them (each built and dispatched before the previous one's tokens are read back; the same tokens), "
        "median time from one readback to the next"
    )
    print(f"compiles after warm-up: {runner.compiles_after_warmup}")
    xla_cross_check(runner, cfg, results[-1])


if __name__ == "__main__":
    main()
