"""Where a decode step's time goes on the real model, without a profiler: the scheduler's host work, the
compiled call (argument handling, then as much of the step as runs before the call returns), and the wait
for the step's outputs; and what the call's arguments alone cost.

    python -m bench.step_costs [--batch-sizes 1,8] [--quantization auto --kv-cache-dtype bfloat16
                               --activation-quantization int8]

Per batch: B prompts of `--input-len` random tokens decoded greedily for `--output-len` tokens by an
in-process `Engine`, each part of `Scheduler._step` timed by wrapping it (medians over the decode steps, after
a warm-up run; host = the step less its call and wait, step by step). Then a trivial program taking the
same arguments as the step (the weights as a flat list, the pools, donated, and the step's batch), jitted with
`keep_unused` so none is pruned: its call is the argument handling alone, which the weights' count sets; and
one without the weights. What removing the host's round trip buys: `python -m bench.engine_throughput
--num-continuous-decode-steps 1,4` (K decode steps a call); what overlapping the host's work with the
device buys: its `--overlap-schedule on,off`. The steps here run one at a time (`--disable-overlap-schedule`),
so that each part is the step's own (`step_parts` turns the overlap off while it measures).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from bench.engine_flags import add_engine_flags, engine_kwargs

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
    while sched.has_work():  # a step the last generate left in flight (the overlap schedule)
        sched.step()
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
    cfg, sched.cfg = sched.cfg, dataclasses.replace(sched.cfg, overlap_schedule=False)  # a step's own parts
    try:
        engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        for name in ("_schedule", "_build", "_collect", "_step"):
            del sched.__dict__[name]
        del runner.__dict__["step"]
        sched.cfg = cfg
    if any(len(v) != len(decode) for v in logs.values()):
        counts = [len(v) for v in logs.values()]
        raise RuntimeError(f"a step was scheduled more than once (retractions?): {counts}")
    ms = {part: 1e3 * np.asarray(v)[decode] for part, v in logs.items()}
    out = {part: float(np.median(v)) for part, v in ms.items()}
    # per step, then the median: XLA:CPU runs some steps whole inside the call (a long call, a short wait)
    out["host"] = float(np.median(ms["step"] - ms["call"] - ms["wait"]))
    return out


def argument_costs(engine, batch_size: int, repeats: int = 200) -> dict[str, float]:
    """Median us a call of a trivial program on the step's own arguments takes to return (the decode shape
    of `batch_size` rows), with and without the weights; and how many arguments of each kind there are."""
    runner = engine.scheduler.runner
    decode_shapes = [s for k, s in runner.programs() if k == "step" and not s.prefill_blocks]
    shape = min((s for s in decode_shapes if s.decode >= batch_size), key=lambda s: (s.decode, s.pages))
    batch = runner.dummy_batch(shape)

    def trivial(*args):  # ([weights,] pools, batch): the pools back unchanged, donated as a step's are
        return jax.tree.leaves(args[-1])[0] + 1, args[-2]

    out = {"weights": len(runner._params_flat), "pools": len(jax.tree.leaves(runner.pools)),
           "batch": len(jax.tree.leaves(batch))}
    for key, weights in (("with_weights_us", (runner._params_flat,)), ("without_weights_us", ())):
        fn = jax.jit(trivial, donate_argnums=(len(weights),), keep_unused=True)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result, runner.pools = fn(*weights, runner.pools, batch)
            times.append(time.perf_counter() - start)
            jax.block_until_ready(result)
        out[key] = 1e6 * float(np.median(times))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    add_engine_flags(p)
    a = p.parse_args(argv)

    from serve import Engine

    sizes = [int(b) for b in a.batch_sizes.split(",")]
    engine = Engine(in_process=True, **engine_kwargs(a), max_running_requests=max(8, *sizes),
                    context_length=a.input_len + a.output_len + 64,
                    max_total_tokens=max(sizes) * (a.input_len + a.output_len + 64) + 1024)
    params = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
    rng = np.random.default_rng(0)
    print("| batch | step ms | host ms | call ms | wait ms | schedule / build / collect ms | arguments "
          "(weights, pools, batch) | their call us | without the weights us |")
    print("|---" * 9 + "|")
    for size in sizes:
        prompts = rng.integers(100, 20000, (size, a.input_len)).tolist()
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        engine.scheduler.flush_cache()
        t = step_parts(engine, prompts, params)
        args = argument_costs(engine, size)
        print(f"| {size} | {t['step']:.2f} | {t['host']:.2f} | {t['call']:.2f} | {t['wait']:.2f} | "
              f"{t['schedule']:.2f} / {t['build']:.2f} / {t['collect']:.2f} | "
              f"{args['weights']}, {args['pools']}, {args['batch']} | {args['with_weights_us']:.0f} | "
              f"{args['without_weights_us']:.0f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
