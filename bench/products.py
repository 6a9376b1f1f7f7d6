"""SmolLM2's decode products (4-bit weights in stored panels, int8 activations), chained layer after layer as
in a decode step, at a few row counts, against the XLA read bandwidth measured in the same run.

A decode step's products read each layer's weights once, from DRAM, one after the other, and a product's
time from DRAM can be its read time plus its multiply time when nothing reads ahead of the multiplies
(kernels/cpu/qgemm_i8.cc `stored_fetch`). Here one jitted loop runs `--layers` layers of SmolLM2's four
products (q|k|v 576 -> 960, o 576 -> 576, gate|up 576 -> 3,072, down 1,536 -> 576), each feeding the next:

- `dram`: every layer its own random weights (66 MB for 30 layers: more than the last-level cache);
- `cache`: two layers' weights cycled, so after the first pass they come from cache: the multiplies alone.

    python -m bench.products [--rows 1,8,16,32] [--layers 30] [--repeats 15]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.roofline import call_seconds, measure_memory_bandwidth
from kernels import cpu
from kernels.quant.reference import PANEL, quantize, to_panels

HIDDEN = 576
WEIGHT_STD = 0.05
# (outputs, inputs) of a layer's products in order; an output wider than the next input is cut to it
SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (3072, HIDDEN), (HIDDEN, 1536))


def make_weights(layers: int, rng: np.random.Generator) -> list[tuple[jax.Array, ...]]:
    """`layers` x SHAPES random 4-bit weights in stored panels: (q, scale, zero) a product."""
    out = []
    for _ in range(layers):
        for n, k in SHAPES:
            q, scale, zero = quantize(rng.standard_normal((n, k), dtype=np.float32) * WEIGHT_STD, 4)
            out.append(tuple(jnp.asarray(a) for a in to_panels(q, scale, zero)))
    return out


def chain(weights, x: jax.Array, layers: int) -> jax.Array:
    """`layers` layers of SHAPES' products, cycling over `weights` (len(SHAPES) entries a layer)."""
    per_layer = len(SHAPES)
    for i in range(layers * per_layer):
        q, scale, zero = weights[i % len(weights)]
        k, k_next = SHAPES[i % per_layer][1], SHAPES[(i + 1) % per_layer][1]
        y = cpu.qmatmul_native(x, q, scale, zero, activations="int8", layout="panels")
        x = y[:, :k_next] / (WEIGHT_STD * np.sqrt(k))  # every output is at least the next input; unit scale
    return x.sum()


def weight_bytes(weights) -> int:
    return sum(a.nbytes for w in weights for a in w)


def run(rows: int, layers: int, weights, cached, repeats: int, rng: np.random.Generator) -> dict:
    """Best and median seconds of the chained products from DRAM (`weights`) and from cache (`cached`)."""
    x = jnp.asarray(rng.standard_normal((rows, HIDDEN), dtype=np.float32))
    fn = jax.jit(chain, static_argnums=2)
    out = {"rows": rows}
    for name, w in (("dram", weights), ("cache", cached)):
        compiled = fn.lower(w, x, layers).compile()
        times = call_seconds(lambda: compiled(w, x), repeats)
        out[f"{name}_best_ms"], out[f"{name}_median_ms"] = 1e3 * times[0], 1e3 * times[len(times) // 2]
    out["mb"] = weight_bytes(weights) / 1e6
    out["gb_s"] = out["mb"] / out["dram_best_ms"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32", help="comma-separated row counts")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    from serve import native_kernels
    from serve.server_args import ServerArgs

    native_kernels.configure(ServerArgs().resolved_cache_dir())
    if cpu.panel_width() != PANEL:
        raise SystemExit("the native library has no stored-panel kernel here "
                         "(built with AVX512-VNNI or AVX2)")
    rng = np.random.default_rng(0)
    weights = make_weights(args.layers, rng)
    cached = weights[: 2 * len(SHAPES)]
    bandwidth = measure_memory_bandwidth() / 1e9
    print(f"{args.layers} layers of SmolLM2's products, 4-bit stored panels, int8 activations: "
          f"{weight_bytes(weights) / 1e6:.1f} MB; XLA read bandwidth {bandwidth:.1f} GB/s")
    print("| rows | from DRAM ms (best / median) | GB/s | of the read bandwidth | from cache ms "
          "| DRAM - cache ms |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        r = run(rows, args.layers, weights, cached, args.repeats, rng)
        print(f"| {rows} | {r['dram_best_ms']:.2f} / {r['dram_median_ms']:.2f} | {r['gb_s']:.1f} | "
              f"{r['gb_s'] / bandwidth:.0%} | {r['cache_best_ms']:.2f} | "
              f"{r['dram_best_ms'] - r['cache_best_ms']:.2f} |")


if __name__ == "__main__":
    main()
