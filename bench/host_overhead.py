"""The scheduler's host work per step (scheduling, batch build, output handling) at a large batch, on a tiny
random model whose device step is short: what a fast accelerator would wait on between steps.

    python -m bench.host_overhead --batch-sizes 32,128
    python -m bench.host_overhead --batch-sizes 32 --slots 64 --speculative-algorithm ngram  # drafting

Each batch: B prompts of `--input-len` random tokens decoded greedily for `--output-len` tokens with the
scheduler in this process (`Engine(in_process=True)`), profiled once after a warm-up run; the profile's
cumulative times of the step's parts, per step. The device's share is the time spent waiting for a step's
outputs (`fetch_outputs`); everything else in `Scheduler.step` is host work. Profiling inflates Python time
(about 1.5-2x), so compare runs of this script with each other, not with a served step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile

import numpy as np

PARTS = {  # label: (file suffix, function name) in the profile
    "step (all)": ("scheduler/scheduler.py", "step"),
    "schedule": ("scheduler/scheduler.py", "_schedule"),
    "drafting": ("scheduler/speculative.py", "add_drafts"),  # (within schedule; 0 without speculation)
    "build batch": ("scheduler/stepping.py", "_build"),
    "device wait + fetch": ("scheduler/outputs.py", "fetch_outputs"),
    "collect outputs": ("scheduler/stepping.py", "_collect"),
}
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  max_position_embeddings=4096)


def part_seconds(stats: pstats.Stats) -> dict[str, float]:
    out = dict.fromkeys(PARTS, 0.0)
    for (file, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        for label, (suffix, fn) in PARTS.items():
            if name == fn and file.endswith(suffix):
                out[label] += cumulative
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="32,128")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--speculative-algorithm", default=None, choices=[None, "ngram"])
    p.add_argument("--slots", type=int, default=None,
                   help="request slots (decode rows) per engine (default: the batch; more: room for drafts)")
    a = p.parse_args()

    from bench.random_checkpoint import write_checkpoint
    from serve import Engine
    from serve.model_source import resolve_model
    from serve.server_args import ServerArgs
    from serve.tokenizer import tokenizer_dir

    server = ServerArgs()
    cache_dir = server.resolved_cache_dir()
    with tempfile.TemporaryDirectory() as model_dir:
        tokenizer = tokenizer_dir(resolve_model(server.model, cache_dir), cache_dir)
        write_checkpoint(model_dir, TINY_LLAMA, tokenizer)
        print("batch | steps | " + " | ".join(f"{label} ms/step" for label in PARTS) + " | host ms/step")
        for batch in [int(b) for b in a.batch_sizes.split(",")]:
            engine = Engine(model=model_dir, in_process=True, max_running_requests=max(batch, a.slots or 0),
                            context_length=a.input_len + a.output_len + 64,
                            max_total_tokens=batch * (a.input_len + a.output_len + 32) + 1024,
                            speculative_algorithm=a.speculative_algorithm)
            prompts = np.random.default_rng(0).integers(100, 20000, (batch, a.input_len)).tolist()
            params = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
            engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
            steps_before = engine.scheduler.num_steps
            profile = cProfile.Profile()
            profile.enable()
            engine.generate(input_ids=prompts, sampling_params=params)
            profile.disable()
            steps = engine.scheduler.num_steps - steps_before
            parts = {k: 1e3 * v / steps for k, v in part_seconds(pstats.Stats(profile)).items()}
            host = parts["step (all)"] - parts["device wait + fetch"]
            print(f"{batch} | {steps} | " + " | ".join(f"{v:.2f}" for v in parts.values()) + f" | {host:.2f}")
            engine.shutdown()


if __name__ == "__main__":
    main()
