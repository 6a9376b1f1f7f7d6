"""Where a decode step's time goes on the real model, without a profiler: the scheduler's host work, the
compiled call (argument handling, then as much of the step as runs before the call returns), and the wait
for the step's outputs; and what the call's arguments alone cost.

    python -m bench.step_costs [--batch-sizes 1,8] [--quantization auto --kv-cache-dtype bfloat16
                               --activation-quantization int8] [--multi-step 4]

Per batch: B prompts of `--input-len` random tokens decoded greedily for `--output-len` tokens by an
in-process `Engine`, each part of `Scheduler._step` timed by wrapping it (medians over the decode steps, after
a warm-up run; host = the step less its call and wait, step by step). Then a trivial program taking the
same arguments as the step (the weights as a flat list, the pools, donated, and the step's batch), jitted with
`keep_unused` so none is pruned: its call is the argument handling alone, which the weights' count sets; and
one without the weights. `--multi-step K`: the requests'
decode tokens/s again with `--num-continuous-decode-steps K` (K steps a call, no host round trip between
them) against 1, in the same process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import numpy as np

from models.quantization import ACTIVATION_QUANTIZATION_CHOICES

PARTS = ("schedule", "build", "call", "wait", "collect", "step")


def timed(obj, name: str, log: list[float]) -> None:
    """Wraps `obj.name` so each call appends its seconds to `log`."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            log.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def step_parts(engine, prompts: list[list[int]], params: dict) -> dict[str, float]:
    """Median ms of each part of the decode steps of one `generate` (the first steps, prefill, left out)."""
    sched = engine.scheduler
    logs = {part: [] for part in PARTS}
    for part, name in (("schedule", "_schedule"), ("build", "_build"), ("collect", "_collect"),
                       ("step", "_step")):
        timed(sched, name, logs[part])
    runner = sched.runner
    inner_step = runner.step
    decode = []  # whether each step was decode-only

    def step(batch, shape):  # the call returns before the step is done; the wait is for its outputs
        decode.append(shape.prefill_blocks == 0)
        start = time.perf_counter()
        out = inner_step(batch, shape)
        mid = time.perf_counter()
        jax.block_until_ready(out)
        logs["call"].append(mid - start)
        logs["wait"].append(time.perf_counter() - mid)
        return out

    runner.step = step
    try:
        engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        for name in ("_schedule", "_build", "_collect", "_step"):
            del sched.__dict__[name]
        del runner.__dict__["step"]
    if any(len(v) != len(decode) for v in logs.values()):
        counts = [len(v) for v in logs.values()]
        raise RuntimeError(f"a step was scheduled more than once (retractions?): {counts}")
    ms = {part: 1e3 * np.asarray(v)[decode] for part, v in logs.items()}
    out = {part: float(np.median(v)) for part, v in ms.items()}
    # per step, then the median: XLA:CPU runs some steps whole inside the call (a long call, a short wait)
    out["host"] = float(np.median(ms["step"] - ms["call"] - ms["wait"]))
    return out


def call_us(fn: Callable, args_of: Callable, repeats: int = 200) -> float:
    """Median microseconds of `fn(*args_of())` returning (not waiting for its result)."""
    times = []
    for _ in range(repeats):
        args = args_of()
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return 1e6 * float(np.median(times))


def argument_costs(engine, batch_size: int) -> dict[str, float]:
    """Call times of trivial programs on the step's own arguments (the decode shape of `batch_size` rows)."""
    runner = engine.scheduler.runner
    decode_shapes = [s for k, s in runner.programs() if k == "step" and not s.prefill_blocks]
    shape = min((s for s in decode_shapes if s.decode >= batch_size), key=lambda s: (s.decode, s.pages))
    batch = runner.dummy_batch(shape)
    state = {"pools": runner.pools}

    def with_weights(params, pools, batch):
        return jax.tree.leaves(batch)[0] + 1, pools

    def without(pools, batch):
        return jax.tree.leaves(batch)[0] + 1, pools

    full = jax.jit(with_weights, donate_argnums=(1,), keep_unused=True)
    bare = jax.jit(without, donate_argnums=(0,), keep_unused=True)

    def run_full(params, pools, batch):
        out, state["pools"] = full(params, pools, batch)
        return out

    def run_bare(pools, batch):
        out, state["pools"] = bare(pools, batch)
        return out

    try:
        counts = {"weights": len(runner._params_flat), "pools": len(jax.tree.leaves(runner.pools)),
                  "batch": len(jax.tree.leaves(batch))}
        out = {"with_weights_us": call_us(run_full, lambda: (runner._params_flat, state["pools"], batch)),
               "without_weights_us": call_us(run_bare, lambda: (state["pools"], batch))}
        return {**counts, **out}
    finally:
        runner.pools = state["pools"]


def decode_tok_s(engine, prompts: list[list[int]], params: dict) -> float:
    """The requests' decode tokens/s: tokens after the first over the time after a 1-token run's."""
    engine.scheduler.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
    first = time.perf_counter() - start
    engine.scheduler.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    return (sum(len(o["output_ids"]) for o in outs) - len(prompts)) / (seconds - first)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--model", default=None, help="path or alias (default: the server's default model)")
    p.add_argument("--quantization", default=None)
    p.add_argument("--activation-quantization", default="none", choices=ACTIVATION_QUANTIZATION_CHOICES)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--multi-step", type=int, default=0,
                   help="also decode tokens/s with this many continuous decode steps a call against 1")
    a = p.parse_args(argv)

    from serve import Engine

    sizes = [int(b) for b in a.batch_sizes.split(",")]
    common = dict(in_process=True, quantization=a.quantization,
                  activation_quantization=a.activation_quantization, kv_cache_dtype=a.kv_cache_dtype,
                  max_running_requests=max(8, *sizes),
                  context_length=a.input_len + a.output_len + 64,
                  max_total_tokens=max(sizes) * (a.input_len + a.output_len + 64) + 1024)
    if a.model:
        common["model"] = a.model
    params = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
    rng = np.random.default_rng(0)
    engines = {1: Engine(**common)}
    if a.multi_step > 1:
        engines[a.multi_step] = Engine(num_continuous_decode_steps=a.multi_step, **common)
    print("| batch | step ms | host ms | call ms | wait ms | schedule / build / collect ms | arguments "
          "(weights, pools, batch) | their call us | without the weights us |"
          + (f" decode tok/s, 1 / {a.multi_step} steps a call |" if a.multi_step > 1 else ""))
    print("|---" * (10 if a.multi_step > 1 else 9) + "|")
    for size in sizes:
        prompts = rng.integers(100, 20000, (size, a.input_len)).tolist()
        engine = engines[1]
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        engine.scheduler.flush_cache()
        t = step_parts(engine, prompts, params)
        args = argument_costs(engine, size)
        line = (f"| {size} | {t['step']:.2f} | {t['host']:.2f} | {t['call']:.2f} | {t['wait']:.2f} | "
                f"{t['schedule']:.2f} / {t['build']:.2f} / {t['collect']:.2f} | "
                f"{args['weights']}, {args['pools']}, {args['batch']} | {args['with_weights_us']:.0f} | "
                f"{args['without_weights_us']:.0f} |")
        if a.multi_step > 1:
            rates = {k: [] for k in engines}
            for _ in range(2):  # alternated
                for k, e in engines.items():
                    rates[k].append(decode_tok_s(e, prompts, params))
            line += f" {max(rates[1]):.1f} / {max(rates[a.multi_step]):.1f} |"
        print(line, flush=True)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
