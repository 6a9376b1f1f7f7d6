"""Decode attention over a model's whole KV pool (every layer's, so read from DRAM as in a decode step) vs the
memory bandwidth measured in the same run; and prefill attention after a cached prefix, vs the matmul FLOP/s.

`bench.kernels` times one layer's call, whose pools a 2-core CPU holds in L3; a decode step reads 30 layers'
pools, so what it waits on is DRAM. Here one jitted loop calls the native decode attention once per layer of
SmolLM2-shaped pools (9 query and 3 KV heads of 64, pages of 16) in the layouts a server meets:

    python -m bench.decode_attention [--cases b32,b1,gsp8,gsp,spec,prefill] [--pool bfloat16|float32]
                                     [--queries float32|bfloat16] [--repeats 15]

Cases: `b32` 32 rows of 640 tokens each; `b1` one row of 2,048; `gsp8` 16 rows in 8 pairs sharing a
1,024-token prefix (the radix cache's pages) + 192 tokens each; `gsp` 16 rows sharing 1,024 + 160 each;
`spec` the 8 rows of a speculative verify step sharing 608 tokens. KV GB/s counts each distinct page once
(shared pages once a group), against the XLA read bandwidth measured before the cases. `prefill`: 16
sequences adding 128 tokens each after 1,024 cached ones (the shared-prefix benchmark's questions), in query
blocks of 16, every layer; its GFLOP/s count the visible keys' products against the measured matmul rate.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.roofline import call_seconds, measure_matmul_flops, measure_memory_bandwidth
from kernels.cpu import available, decode_attention_native, prefill_attention_native

LAYERS, PAGE, KV_HEADS, HEAD_DIM, HEADS = 30, 16, 3, 64, 9
CASES = {  # name -> (rows, shared prefix tokens, own tokens a row, groups sharing a prefix)
    "b32": (32, 0, 640, 32),
    "b1": (1, 0, 2048, 1),
    "gsp8": (16, 1024, 192, 8),
    "gsp": (16, 1024, 160, 1),
    "spec": (8, 608, 0, 1),
    "prefill": (16, 1024, 128, 16),  # new tokens after a cached prefix, each sequence its own pages
}
PREFILL_BLOCK = 16


def _page_table(rows: int, shared: int, own: int, groups: int) -> np.ndarray:
    """Rows in `groups` equal groups, each group's rows starting with the same `shared` tokens' pages."""
    sp, so = shared // PAGE, own // PAGE
    common = np.repeat(np.arange(groups * sp).reshape(groups, sp), rows // groups, axis=0)
    mine = groups * sp + np.arange(rows * so).reshape(rows, so)
    return np.concatenate([common, mine], axis=1) + 1  # page 0 unused


def run_case(name: str, pool_dtype, repeats: int, rng: np.random.Generator,
             query_dtype=jnp.float32) -> dict:
    rows, shared, own, groups = CASES[name]
    table = _page_table(rows, shared, own, groups)
    slots = (int(table.max()) + 1) * PAGE
    k = jnp.asarray(rng.standard_normal((LAYERS, slots, KV_HEADS, HEAD_DIM)), pool_dtype)
    v = jnp.asarray(rng.standard_normal((LAYERS, slots, KV_HEADS, HEAD_DIM)), pool_dtype)
    q = jnp.asarray(rng.standard_normal((LAYERS, rows, HEADS, HEAD_DIM)), jnp.float32)
    pages = jnp.asarray(table, jnp.int32)
    positions = jnp.full((rows,), shared + own - 1, jnp.int32)

    if name == "prefill":  # each row's `own` new tokens in query blocks, after its `shared` cached ones
        q = jnp.asarray(rng.standard_normal((LAYERS, rows * own, HEADS, HEAD_DIM)), jnp.float32)
        pages = jnp.asarray(np.repeat(table, own // PREFILL_BLOCK, axis=0), jnp.int32)
        positions = jnp.asarray(np.tile(shared + np.arange(own), rows), jnp.int32)

    def attend(q, k, v, i):
        if name == "prefill":
            return prefill_attention_native(q, k, v, i, pages, positions, page_size=PAGE,
                                            block_size=PREFILL_BLOCK, scale=HEAD_DIM**-0.5)
        return decode_attention_native(q, k, v, i, pages, positions, page_size=PAGE, scale=HEAD_DIM**-0.5)

    @jax.jit
    def step(q, k, v):
        def layer(i, acc):
            return acc + attend(q[i], k, v, i).astype(jnp.float32)
        return jax.lax.fori_loop(0, LAYERS, layer, jnp.zeros(q.shape[1:], jnp.float32))

    q = q.astype(query_dtype)
    times = call_seconds(lambda: step(q, k, v), repeats)
    tokens = groups * shared + rows * own  # distinct tokens' pages
    kv_bytes = 2 * tokens * KV_HEADS * HEAD_DIM * jnp.dtype(pool_dtype).itemsize * LAYERS
    # Prefill: each new token's query heads against the keys it sees (the cached ones and the new ones up to
    # itself), a multiply-add for the scores and one for the values per element.
    seen = rows * own * (shared + (own + 1) / 2)  # (query token, visible key) pairs
    flops = 4.0 * seen * HEADS * HEAD_DIM * LAYERS if name == "prefill" else 0.0
    return {"case": name, "best_ms": times[0] * 1e3, "median_ms": times[len(times) // 2] * 1e3,
            "kv_mb": kv_bytes / 1e6, "kv_gb_s": kv_bytes / times[0] / 1e9, "gflop_s": flops / times[0] / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--pool", choices=["bfloat16", "float32"], default="bfloat16", help="the KV pools' dtype")
    ap.add_argument("--queries", choices=["bfloat16", "float32"], default="float32",
                    help="the queries' dtype (bf16: the kernels' pair products, as under bf16 activations)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not available():
        raise SystemExit("the native CPU kernels are not available here (see the log for why)")
    bandwidth, flop_rate = measure_memory_bandwidth(), measure_matmul_flops()
    print(f"{LAYERS} layers, {args.pool} pools, {args.queries} queries; XLA read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, matmul {flop_rate / 1e9:.0f} GFLOP/s")
    print(f"{'case':<8}{'best ms':>9}{'median ms':>11}{'KV MB':>8}{'KV GB/s':>9}{'of read BW':>12}")
    rng = np.random.default_rng(0)
    for name in args.cases.split(","):
        r = run_case(name.strip(), jnp.dtype(args.pool), args.repeats, rng, jnp.dtype(args.queries))
        line = (f"{r['case']:<8}{r['best_ms']:>9.2f}{r['median_ms']:>11.2f}{r['kv_mb']:>8.0f}"
                f"{r['kv_gb_s']:>9.1f}")
        if r["gflop_s"]:
            share = 100 * r["gflop_s"] * 1e9 / flop_rate
            line += f"{'':>12}  {r['gflop_s']:.0f} GFLOP/s, {share:.0f}% of matmul"
        else:
            line += f"{100 * r['kv_gb_s'] * 1e9 / bandwidth:>11.0f}%"
        print(line)


if __name__ == "__main__":
    main()
