"""Mamba-2 and Gated DeltaNet serving cost on the ModelRunner: cached decode vs full recompute across
contexts, prefill, memory.

A random-weight model built in memory (no download needed): by default of the `state-spaces/mamba2-130m`
shape; `--model qwen3-next-4l` a Qwen3-Next of 4 layers (3 Gated DeltaNet, 1 gated attention;
bench/random_checkpoint.py SHAPES), whose one attention layer is the only part of a decode step that grows
with the context. Decode is timed after a real prefill of `context` tokens per sequence; the baseline
without a recurrent state has to recompute the whole sequence for every new token, i.e. one prefill of
`context` tokens per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.one_batch import decode_works, prefill_plan
from bench.random_checkpoint import SHAPES
from bench.roofline import measure_roofline
from memory import PageAllocator, ReqToTokenPool
from memory.pools import kv_pool_bytes_per_token
from models.layers.stack import resolve_layer_weights, stack_layers
from models.registry import model_class, model_module
from runtime.batch_builder import build_step_batch
from runtime.buckets import Buckets
from runtime.runner import ModelRunner, RunnerConfig
from serve import native_kernels
from serve.server_args import ServerArgs

MAMBA2_130M = dict(
    architectures=["Mamba2ForCausalLM"], model_type="mamba2", vocab_size=50288, hidden_size=768,
    num_hidden_layers=24,
    state_size=128, head_dim=64, num_heads=24, expand=2, n_groups=1, conv_kernel=4, use_conv_bias=True,
    use_bias=False, layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=True, chunk_size=256,
    time_step_limit=[0.0, float("inf")], bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
# The vocabulary cut from Qwen3-Next's 151,936 to 32,000: its untied LM head would add 1.2 GB of float32 reads
# to every decode step (about 40 ms here), the same at every context.
QWEN3_NEXT_4L = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=32000, bos_token_id=0, eos_token_id=0,
                     **{k: v for k, v in SHAPES["qwen3-next-4l"].items() if k != "model_type"})
MODELS = {"mamba2-130m": MAMBA2_130M, "qwen3-next-4l": QWEN3_NEXT_4L}


def random_model(hf: dict, dtype, seed: int = 0):
    """The model of HF config `hf` with small random weights (A_log, dt_bias and norms in their usual
    ranges)."""
    arch = hf["architectures"][0]
    cfg = model_module(arch).config_from_hf(hf)
    model = model_class(arch)(cfg, dtype=dtype)
    if resolve_layer_weights("auto") == "stacked":  # as the loader lays them out on this backend
        model = stack_layers(model)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = path[-1]
        shape = var.shape
        if "A_log" in path or name == "A_log":
            value = np.log(rng.uniform(1, 16, shape))
        elif "dt_bias" in path or name == "dt_bias":
            value = np.log(np.expm1(rng.uniform(1e-3, 1e-1, shape)))
        elif "norm" in "/".join(map(str, path)) or name == "D":
            value = np.ones(shape)
        else:
            value = rng.normal(0, 0.02, shape)
        flat.append((path, var.replace(jnp.asarray(value, var.dtype))))
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))


def timed_prefill(runner: ModelRunner, table: ReqToTokenPool, rows: list[int], prompts: np.ndarray,
                  chunk: int, start: int = 0) -> tuple[float, np.ndarray]:
    """Prefills every row's prompt from position `start` (the rows already hold the tokens before it);
    returns (seconds, first sampled token per row)."""
    rc = runner.cfg
    plan = [[dataclasses.replace(w, start_pos=w.start_pos + start, reset_penalties=w.start_pos + start == 0,
                                 num_prompt_tokens=prompts.shape[1]) for w in works]
            for works in prefill_plan(rows, prompts[:, start:], rc.buckets, chunk)]
    t0 = time.perf_counter()
    outs = []
    for works in plan:
        batch, layout = build_step_batch(works, rc, table.table, False)
        outs.append((works, layout, runner.step(batch, layout.shape)))
    jax.block_until_ready([o for _, _, o in outs])
    seconds = time.perf_counter() - t0
    first = {}
    for works, layout, out in outs:
        ids = np.asarray(out.next_ids)
        for w, seq_row in zip(works, layout.seq_rows):
            if w.start_pos + len(w.token_ids) == prompts.shape[1]:
                first[w.row] = ids[seq_row]
    return seconds, np.array([first[r] for r in rows], np.int32)


def timed_decode(runner: ModelRunner, table: ReqToTokenPool, rows: list[int], tokens: np.ndarray,
                 context: int, steps: int) -> dict:
    """`steps` greedy decode steps of the rows, the first at position `context`; the median step (the first,
    a warm-up, not counted) and the range."""
    rc = runner.cfg
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        step_batch, layout = build_step_batch(decode_works(rows, tokens, context + s, context), rc,
                                              table.table, False)
        out = jax.block_until_ready(runner.step(step_batch, layout.shape))
        tokens = np.asarray(out.next_ids)[layout.seq_rows]
        times.append(time.perf_counter() - t0)
    timed = times[1:] if len(times) > 1 else times
    step = statistics.median(timed)
    return {"decode_step_ms": step * 1e3, "decode_tok_s": len(rows) / step,
            "decode_step_min_ms": min(timed) * 1e3, "decode_step_max_ms": max(timed) * 1e3}


def _rows(runner: ModelRunner, batch: int, tokens: int) -> tuple[ReqToTokenPool, list[int]]:
    rc = runner.cfg
    table = ReqToTokenPool(rc.max_running_requests, rc.buckets.max_pages, PageAllocator(rc.num_pages),
                           rc.page_size)
    rows = [table.allocate_row() for _ in range(batch)]
    for r in rows:
        assert table.reserve(r, tokens)
    return table, rows


def run_context(runner: ModelRunner, cfg, batch: int, context: int, args) -> dict:
    table, rows = _rows(runner, batch, context + args.decode_steps)
    prompts = np.random.default_rng(context + batch).integers(0, cfg.vocab_size, (batch, context),
                                                              dtype=np.int32)
    prefill_s, tokens = timed_prefill(runner, table, rows, prompts, args.chunked_prefill_size)
    decode = timed_decode(runner, table, rows, tokens, context, args.decode_steps)
    for r in rows:
        table.free_row(r)
    return {"batch": batch, "context": context, "prefill_s": prefill_s,
            "prefill_tok_s": batch * context / prefill_s, **decode,
            # Without a state, each new token costs a prefill of the whole sequence.
            "recompute_tok_s": batch / prefill_s}


def run_contexts_grown(runner: ModelRunner, cfg, batch: int, contexts: list[int], args) -> Iterator[dict]:
    """`run_context` for each context in turn on the same sequences, grown from one context to the next:
    each prefill feeds only the tokens after the last decode step (one prefill of the longest context in all,
    instead of one of every context). Its prefill figures are for those tokens, at the context they start
    from; there is no recompute baseline."""
    steps = args.decode_steps
    table, rows = _rows(runner, batch, max(contexts) + steps)
    prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, max(contexts)), dtype=np.int32)
    pos = 0
    for context in contexts:
        if context <= pos:
            raise ValueError(f"--grow needs increasing contexts more than {steps} apart: {context} after "
                             f"{pos - steps}")
        prefill_s, tokens = timed_prefill(runner, table, rows, prompts[:, :context],
                                          args.chunked_prefill_size, start=pos)
        decode = timed_decode(runner, table, rows, tokens, context, steps)
        yield {"batch": batch, "context": context, "prefill_from": pos, "prefill_s": prefill_s,
               "prefill_tok_s": batch * (context - pos) / prefill_s, **decode, "recompute_tok_s": None}
        pos = context + steps
    for r in rows:
        table.free_row(r)


def run_contexts_interleaved(runner: ModelRunner, cfg, batch: int, contexts: list[int], args) -> list[dict]:
    """The decode step at every context on the same sequences, prefilled once to the longest: `args.rounds`
    rounds, each decoding `args.decode_steps` steps from every context in turn (the order reversed every other
    round), so that a drift of the machine's speed over the run does not pass for a trend in the context.
    A step from position `context` attends to the first `context` tokens only, so it costs what it costs on a
    sequence of that length (it overwrites the cached K/V of the positions it decodes, which nothing here
    reads again). Per context: the median over the rounds of each round's median step, and their range."""
    steps, longest = args.decode_steps, max(contexts)
    table, rows = _rows(runner, batch, longest + steps)
    prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, longest), dtype=np.int32)
    prefill_s, tokens = timed_prefill(runner, table, rows, prompts, args.chunked_prefill_size)
    medians: dict[int, list[float]] = {c: [] for c in contexts}
    for r in range(args.rounds):
        for context in contexts if r % 2 == 0 else contexts[::-1]:
            step = timed_decode(runner, table, rows, tokens, context, steps)
            medians[context].append(step["decode_step_ms"])
    for r in rows:
        table.free_row(r)
    return [{"batch": batch, "context": c, "prefill_s": prefill_s,
             "prefill_tok_s": batch * longest / prefill_s, "prefill_context": longest,
             "decode_step_ms": statistics.median(medians[c]),
             "decode_tok_s": batch / statistics.median(medians[c]) * 1e3,
             "decode_step_min_ms": min(medians[c]), "decode_step_max_ms": max(medians[c]),
             "round_medians_ms": medians[c], "recompute_tok_s": None} for c in contexts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="mamba2-130m", choices=sorted(MODELS),
                   help="the shape of the random model")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--contexts", default="128,512,1024,2048,4096")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--prefill-block-size", type=int, default=64,
                   help="SSD / delta-rule chunk (= prefill block) size")
    p.add_argument("--chunked-prefill-size", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--state-snapshots", type=int, default=0,
                   help="prefix-cache snapshot slots in the pools (none is copied here: what their presence "
                   "costs)")
    p.add_argument("--grow", action="store_true",
                   help="decode each context on the same sequences grown from the last one (one prefill of "
                   "the longest context per batch size, not one per context; no recompute baseline)")
    p.add_argument("--rounds", type=int, default=0,
                   help="if > 0: prefill each batch size's sequences once to the longest context, then time "
                   "the decode step at every context in this many interleaved rounds (median of the rounds' "
                   "medians, their range in parentheses; no recompute baseline)")
    p.add_argument("--output-file", default=None, help="append one JSON line per (batch, context)")
    args = p.parse_args()
    # The native CPU kernels take CXX, XLASERVE_CPU_KERNELS, ... as the server does (serve/native_kernels.py).
    native_kernels.configure(ServerArgs().resolved_cache_dir())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = jnp.dtype(args.dtype)

    roof = measure_roofline(dtype)
    print(f"device {roof.device}, jax {jax.__version__}, dtype {dtype.name}; roofline: read "
          f"{roof.bandwidth_bytes_per_s / 1e9:.1f} GB/s, matmul {roof.matmul_flops_per_s / 1e9:.1f} GFLOP/s")
    cfg, model = random_model(MODELS[args.model], dtype)
    page_size, max_context = 64, max(contexts) + args.decode_steps
    buckets = Buckets.make(max_running_requests=max(batch_sizes),
                           chunked_prefill_size=args.chunked_prefill_size,
                           prefill_block_size=args.prefill_block_size, max_context_len=max_context,
                           page_size=page_size, min_page_width_tokens=max_context)
    max_pages = buckets.max_pages
    runner = ModelRunner(model, cfg, RunnerConfig(page_size, max(batch_sizes) * max_pages + 1,
                                                  max(batch_sizes), buckets, cfg.vocab_size,
                                                  state_snapshots=args.state_snapshots), dtype)
    del model
    state_bytes = runner.pools.recurrent.ssm.nbytes + runner.pools.recurrent.conv.nbytes
    spec = cfg.cache_spec
    per_slot = spec.recurrent.bytes_per_slot(dtype)
    # K and V of one token over the attention layers (0 for pure Mamba-2): what decode attention reads per
    # token of context.
    kv_per_token = (kv_pool_bytes_per_token(spec.num_kv_layers, spec.num_kv_heads, spec.head_dim, dtype)
                    if spec.num_kv_layers else 0)
    print(f"{args.model} shape: {cfg.num_params / 1e6:.1f} M params, "
          f"weights {runner.weight_bytes / 2**20:.0f} MiB, "
          f"state {per_slot / 2**20:.2f} MiB per sequence ({state_bytes / 2**20:.0f} MiB pool)"
          + (f", KV {kv_per_token / 2**10:.1f} KiB per token of context" if kv_per_token else ""))
    start = time.perf_counter()
    runner.precompile(progress=False)
    compile_s = time.perf_counter() - start
    print(f"precompile of {len(runner.programs())} step programs: {compile_s:.1f} s")

    # Bytes one batch-1 decode step must move: every weight once (the embedding table only as the LM head
    # where it is tied: an untied one is read a row per token), the layer states read and written, and the
    # attention layers' K and V of the context read once.
    embed_bytes = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * dtype.itemsize
    step_bytes = runner.weight_bytes - embed_bytes + 2 * per_slot
    results = []
    for b in batch_sizes:
        first = None
        if args.rounds > 0:
            runs = run_contexts_interleaved(runner, cfg, b, contexts, args)
        elif args.grow:
            runs = run_contexts_grown(runner, cfg, b, contexts, args)
        else:
            runs = (run_context(runner, cfg, b, c, args) for c in contexts)
        for r in runs:
            c = r["context"]
            kv_read = b * c * kv_per_token
            r.update(device=roof.device, dtype=dtype.name, compile_s=compile_s, model=args.model,
                     state_snapshots=args.state_snapshots, kv_read_bytes=kv_read,
                     bandwidth_gb_s=roof.bandwidth_bytes_per_s / 1e9)
            roof_ms = (step_bytes + kv_read) / roof.bandwidth_bytes_per_s * 1e3
            if b == 1:
                r["x_bw_roofline"] = r["decode_step_ms"] / roof_ms
            results.append(r)
            print(f"batch {b:>3} context {c:>5}: decode {r['decode_step_ms']:8.2f} ms/step "
                  f"({r['decode_step_min_ms']:.2f}-{r['decode_step_max_ms']:.2f}) "
                  f"{r['decode_tok_s']:8.1f} tok/s "
                  + (f"(recompute baseline {r['recompute_tok_s']:7.2f} tok/s, "
                     f"{r['decode_tok_s'] / r['recompute_tok_s']:6.0f}x); " if r["recompute_tok_s"] else "")
                  + f"prefill {r['prefill_tok_s']:7.0f} tok/s"
                  + (f" (from {r['prefill_from']})" if "prefill_from" in r else "")
                  + (f" (of {r['prefill_context']})" if "prefill_context" in r else "")
                  + (f"; {r['x_bw_roofline']:.2f}x the bandwidth roofline ({roof_ms:.1f} ms)"
                     if b == 1 else ""))
            if first is None:
                first = r
            elif kv_per_token:
                grown = r["decode_step_ms"] - first["decode_step_ms"]
                more_kv = kv_read - first["kv_read_bytes"]
                print(f"{'':>25}vs context {first['context']}: {grown:+.2f} ms "
                      f"({grown / first['decode_step_ms']:+.1%}); "
                      f"{more_kv / 2**20:.1f} MiB more K/V read = "
                      f"{more_kv / roof.bandwidth_bytes_per_s * 1e3:.2f} ms at the roofline bandwidth")
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps(r) + "\n")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    stats = jax.devices()[0].memory_stats() or {}
    device_peak = stats.get("peak_bytes_in_use")
    print(f"peak host RSS {peak:.0f} MiB"
          + (f", peak device memory {device_peak / 2**20:.0f} MiB" if device_peak else ""))


if __name__ == "__main__":
    main()
