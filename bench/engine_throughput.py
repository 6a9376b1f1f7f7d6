"""End-to-end `Engine.generate` throughput (scheduler included), e.g. to measure multi-step decode or the
overlap schedule.

python -m bench.engine_throughput --batch-size 8 --input-len 64 --output-len 128 \
    --num-continuous-decode-steps 1,4 [--overlap-schedule on,off] [--quantization auto \
    --kv-cache-dtype bfloat16 --activation-quantization int8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.engine_flags import add_engine_flags, engine_kwargs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_engine_flags(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-continuous-decode-steps", default="1,4", help="comma-separated values to compare")
    p.add_argument("--overlap-schedule", default="on",
                   help="comma-separated on / off to compare (each with every --num-continuous-decode-steps)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import jax

    from serve import Engine

    rng = np.random.default_rng(a.seed)
    prompts = rng.integers(100, 20000, size=(a.batch_size, a.input_len)).tolist()
    params = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
    print(f"device {jax.devices()[0].platform}:{jax.devices()[0].device_kind}; batch {a.batch_size}, "
          f"input {a.input_len}, output {a.output_len}")
    results = {}
    overlaps = a.overlap_schedule.split(",")
    if not set(overlaps) <= {"on", "off"}:
        raise SystemExit(f"--overlap-schedule takes on / off, not {a.overlap_schedule!r}")
    settings = [(int(s), o) for o in overlaps for s in a.num_continuous_decode_steps.split(",")]
    for steps, overlap in settings:
        engine = Engine(**engine_kwargs(a), max_running_requests=max(a.batch_size, 1),
                        num_continuous_decode_steps=steps, disable_overlap_schedule=overlap == "off",
                        context_length=a.input_len + a.output_len + 16, max_total_tokens=max(
                            4096, a.batch_size * (a.input_len + a.output_len + 32)))
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up (first runs of each program)
        best = float("inf")
        for _ in range(a.repeats):
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            best = min(best, time.perf_counter() - start)
        results[steps, overlap] = [o["output_ids"] for o in outs]
        tokens = sum(len(o["output_ids"]) for o in outs)
        print(f"num_continuous_decode_steps={steps} overlap {overlap}: {best:.2f} s, "
              f"{tokens / best:.1f} output tok/s "
              f"(compiles after warm-up: {engine.server_info()['compiles_after_warmup']})")
        engine.shutdown()
    first = next(iter(results.values()))
    print("outputs identical across settings:", all(r == first for r in results.values()))


if __name__ == "__main__":
    main()
