"""Run in a subprocess with 8 fake CPU devices by tests/runtime/test_mesh.py: greedy tokens and prompt
logprobs of one model under several parallel configurations, as JSON on stdout."""

from __future__ import annotations

import json
import re
import sys

from tests.helpers import greedy


def main() -> None:
    request = json.loads(sys.argv[1])
    import jax

    assert len(jax.devices()) >= 8, jax.devices()
    from runtime.mesh import bytes_on_first_device
    from serve import Engine

    results = {}
    for name, parallel in request["configs"].items():
        engine = Engine(model=request["model"], in_process=True, dtype="float32", max_running_requests=2,
                        chunked_prefill_size=32, context_length=256, max_total_tokens=2048, page_size=16,
                        skip_tokenizer_init=True, max_state_snapshots=16, **parallel)
        try:
            outs = engine.generate(input_ids=request["prompts"],
                                   sampling_params=greedy(16),
                                   return_logprob=True, logprob_start_len=0)
            # Again without prompt logprobs: from the prefix cache (pages, and states for recurrent layers).
            again = engine.generate(input_ids=request["prompts"], sampling_params=greedy(16))
            runner, sched = engine.runner, engine.scheduler
            sched.check_integrity()  # every rank's pages and rows
            idle = (not sched.running and not sched.waiting
                    and sched.num_available_tokens == sched.capacity_tokens
                    and all(table.num_free_rows == table.max_requests for table in sched.rank_tables))
            specs = {}
            from flax import nnx

            for path, var in nnx.to_flat_state(runner.params):
                specs[".".join(map(str, path))] = str(getattr(var[...].sharding, "spec", None))
            kv = runner.pools.kv
            # Activations moved between devices (not reductions or gathers) in the decode-only steps, by op.
            moves, native_matmuls = [], 0
            for key, compiled in runner._compiled.items():
                native_matmuls += compiled.as_text().count("xlaserve_cpu_matmul")
                if key[0] == "step" and key[1].prefill_blocks == 0:
                    for line in compiled.as_text().splitlines():
                        if re.search(r"= \S+ (all-to-all|collective-permute)(-start)?\(", line):
                            op = re.search(r'op_name="([^"]+)"', line)
                            moves.append(op.group(1) if op else line.strip()[:200])
            from models.weights.lazy import STATS  # what loading read, for each shard (serve/setup.py)
            results[name] = {
                "prompts": request["prompts"],
                "output_ids": [o["output_ids"] for o in outs],
                "again_ids": [o["output_ids"] for o in again],
                "again_cached": [o["meta_info"]["cached_tokens"] for o in again],
                "input_logprobs": [[lp for lp, _ in o["meta_info"]["input_token_logprobs"][1:]]
                                   for o in outs],
                "specs": specs,
                "kv_spec": str(getattr(kv.k.sharding, "spec", None)),
                "kv_bytes_per_device": bytes_on_first_device(kv.k),
                "kv_bytes": kv.k.nbytes,
                "num_devices": len(kv.k.sharding.device_set),
                "compiles_after_warmup": runner.compiles_after_warmup,
                "idle_and_free": idle,
                "admitted_per_rank": sched.num_admitted_per_rank,
                "speculative": sched.speculative_info(),
                "num_overlapped_steps": sched.num_overlapped_steps,
                "pool_specs": [str(getattr(x.sharding, "spec", None)) for x in jax.tree.leaves(runner.pools)],
                "decode_moves": moves,
                "native_matmuls": native_matmuls,
                "load": {"shards": [list(s[:1]) + list(s[2:]) for s in STATS.shards],
                         "bytes_read": STATS.bytes_read(), "bytes_of_sources": STATS.bytes_of_sources(),
                         "fallbacks": STATS.fallbacks},
            }
        finally:
            engine.shutdown()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
