"""Per-op timings of the device ops (reference and Pallas kernel) vs the roofline measured in the same run.

For each op: best time, FLOP/s and bytes/s from XLA's `cost_analysis` of the reference (the work a good
kernel must do at least; for the experts, the useful work of the routed rows, since XLA:CPU's dense ragged_dot
counts every expert), and the share of the roofline. A Pallas kernel is timed too where it runs
natively (TPU; GPU for the portable ones); in the CPU interpreter its time means nothing, so on CPU only
its agreement with the reference is reported. On CPU, an op the reference routes into a native CPU kernel
(kernels/cpu: decode and prefill attention) is timed both ways: `reference` is plain jnp, `native` the C++
kernel; so is the 4-bit matmul, whose reference (dequantize, then XLA's dot) is what TPU and GPU run.

    python -m bench.kernels [--quick] [--dtype float32|bfloat16] [--output-file F.jsonl]
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.roofline import best_seconds, cost_of, measure_roofline
from kernels import cpu
from kernels.backend import PALLAS_OPS, KernelBackends, use_kernels
from kernels.quant.reference import quantize
from serve import native_kernels
from serve.server_args import ServerArgs

# Ops whose reference calls a native CPU kernel (kernels/backend.py CPU_OPS) where one applies, and ops that
# have only a native CPU kernel (the reference runs on every other backend).
NATIVE_INSIDE = {"paged_attention (decode)", "paged_attention (prefill)"}
NATIVE_ONLY = {"qmatmul"}


def _cases(quick: bool, dtype) -> dict[str, tuple[str, tuple, dict, dict | None]]:
    """op label -> (op name, args, static kwargs, useful {"flops", "bytes"} where XLA's count is not the work
    the op must do, else None): shapes of a small serving step of each model family."""
    rng = np.random.default_rng(0)

    def rand(*shape, dt=dtype, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dt)

    nb, bs = (4, 64) if quick else (16, 128)  # prefill blocks x block size
    h, p, n, g = 24, 64, 128, 1  # Mamba-2 130m: 24 heads of 64, state 128
    ssd = (rand(nb, bs, h, p), jnp.abs(rand(nb, bs, h, dt=jnp.float32, scale=0.1)),
           -jnp.ones((h,), jnp.float32),
           rand(nb, bs, g, n), rand(nb, bs, g, n), jnp.zeros((nb, h, p, n), jnp.float32),
           jnp.asarray(np.arange(nb) % 2 == 0))
    hg, dk = 16, 64  # MiniMax-like lightning attention heads
    gla = (rand(nb, bs, hg, dk), rand(nb, bs, hg, dk), rand(nb, bs, hg, dk), -jnp.linspace(0.01, 0.5, hg),
           jnp.zeros((nb, hg, dk, dk), jnp.float32), jnp.asarray(np.arange(nb) % 2 == 0))
    t, d, f, e, k = (32, 512, 256, 8, 2) if quick else (128, 1024, 512, 16, 2)  # Qwen3-MoE-like experts
    logits = rng.standard_normal((t, e))
    experts = jnp.asarray(np.argsort(-logits, axis=1)[:, :k], jnp.int32)
    moe = (rand(t, d), jnp.full((t, k), 0.5, jnp.float32), experts, rand(e, d, 2 * f, scale=0.03),
           rand(e, f, d, scale=0.03))
    # XLA:CPU's dense ragged_dot counts every token against every expert; the op's work is T*k rows.
    touched = len(np.unique(np.asarray(experts)))
    moe_useful = {"flops": 2.0 * t * k * 3 * d * f, "bytes": float(touched * 3 * d * f * dtype.itemsize
                                                                    + 2 * t * d * dtype.itemsize)}
    seqs, ctx, page, kvh, qh, hd = (8, 256, 16, 2, 8, 64) if quick else (32, 1024, 16, 4, 16, 128)
    pages_per_seq = ctx // page
    num_pages = seqs * pages_per_seq + 1
    table = jnp.asarray(1 + np.arange(seqs * pages_per_seq).reshape(seqs, pages_per_seq), jnp.int32)
    decode = (rand(seqs, qh, hd), rand(1, num_pages * page, kvh, hd), rand(1, num_pages * page, kvh, hd), 0,
              table,
              jnp.full((seqs,), ctx - 1, jnp.int32))
    # The work: every sequence's keys and values read once (XLA's count of the reference includes its
    # gathered copies, more than a kernel that reads the pages in place must move).
    decode_useful = {"flops": 4.0 * seqs * qh * ctx * hd,
                     "bytes": float((2 * seqs * ctx * kvh * hd + 2 * seqs * qh * hd) * dtype.itemsize)}
    # Prefill after a cached prefix (SmolLM2's heads): each sequence's new tokens in blocks against its pages.
    pseqs, new, cached = (4, 64, 256) if quick else (16, 128, 1024)
    pbs, pqh, pkvh, phd = 16, 9, 3, 64
    ppages = -(-(cached + new) // page)
    ptable = 1 + np.arange(pseqs * ppages).reshape(pseqs, ppages)
    prefill = (rand(pseqs * new, pqh, phd), rand(1, (pseqs * ppages + 1) * page, pkvh, phd),
               rand(1, (pseqs * ppages + 1) * page, pkvh, phd), 0,
               jnp.asarray(np.repeat(ptable, new // pbs, axis=0), jnp.int32),
               jnp.asarray(np.tile(cached + np.arange(new), pseqs), jnp.int32))
    visible = pseqs * sum(cached + i + 1 for i in range(new))  # (query, key) pairs the causal mask keeps
    prefill_useful = {"flops": 4.0 * visible * pqh * phd,
                      "bytes": float((2 * pseqs * (cached + new) * pkvh * phd + 2 * pseqs * new * pqh * phd)
                                     * dtype.itemsize)}
    # A 512-token prefill chunk through SmolLM2's fused gate|up projection in the GGUF's 4-bit blocks.
    qm, qn, qk = (128, 768, 576) if quick else (512, 3072, 576)
    q, scale, zero = quantize(np.asarray(rand(qn, qk, dt=jnp.float32, scale=0.05)), 4)
    qmatmul = (rand(qm, qk), jnp.asarray(q), jnp.asarray(scale), jnp.asarray(zero))
    qbytes = q.nbytes + scale.nbytes + zero.nbytes + qm * (qk * dtype.itemsize + qn * 4)
    qmatmul_useful = {"flops": 2.0 * qm * qn * qk, "bytes": float(qbytes)}
    return {
        "ssd_prefill": ("ssd_prefill", ssd, {}, None),
        "gla_prefill": ("gla_prefill", gla, {"scale": dk**-0.5}, None),
        "experts_ffn": ("experts_ffn", moe, {}, moe_useful),
        "paged_attention (decode)": ("paged_attention", decode, {"page_size": page, "block_size": 1,
                                                                  "scale": hd**-0.5}, decode_useful),
        "paged_attention (prefill)": ("paged_attention", prefill, {"page_size": page, "block_size": pbs,
                                                                    "scale": phd**-0.5}, prefill_useful),
        "qmatmul (4-bit, prefill)": ("qmatmul", qmatmul, {}, qmatmul_useful),
    }


def _reference(op: str):
    package = {"ssd_prefill": "ssd", "gla_prefill": "gla", "experts_ffn": "moe",
               "paged_attention": "paged_attention", "qmatmul": "quant"}
    module = importlib.import_module(f"kernels.{package[op]}.reference")
    return getattr(module, op) if hasattr(module, op) else getattr(module, f"{op}_reference")


def _load_pallas(op: str):
    if op not in PALLAS_OPS:
        return None
    module, name = PALLAS_OPS[op][0].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--check-interpret", action="store_true", help="on CPU, also run each Pallas kernel in "
                    "the interpreter once and report its largest difference from the reference (slow)")
    ap.add_argument("--output-file", help="append one JSON line per op")
    args = ap.parse_args()
    # The native CPU kernels take CXX, XLASERVE_CPU_KERNELS, ... as the server does (serve/native_kernels.py).
    native_kernels.configure(ServerArgs().resolved_cache_dir())
    dtype = jnp.dtype(args.dtype)
    start = time.perf_counter()
    roof = measure_roofline(dtype)
    platform = jax.default_backend()
    print(f"device {roof.device}, jax {jax.__version__}, {roof.dtype}; roofline "
          f"{roof.bandwidth_bytes_per_s / 1e9:.1f} GB/s, {roof.matmul_flops_per_s / 1e9:.0f} GFLOP/s")
    print(f"{'op':<26}{'impl':<12}{'time':>10}{'GFLOP/s':>10}{'GB/s':>9}{'roofline':>10}{'util':>7}")
    for label, (op, operands, static, useful) in _cases(args.quick, dtype).items():
        def run_with(kernels: KernelBackends, _op=op, _kw=static):
            def run(*a):
                with use_kernels(kernels):  # traced inside: the choice is made at trace time
                    return _reference(_op)(*a, **_kw)

            return jax.jit(run)

        ref = run_with(KernelBackends("reference"))  # plain jnp throughout
        cost = cost_of(ref, *operands)
        flops, nbytes = cost["flops"] or 0.0, cost["bytes_accessed"] or 0.0
        if useful:
            flops, nbytes = useful["flops"], useful["bytes"]
        bound = max(flops / roof.matmul_flops_per_s, nbytes / roof.bandwidth_bytes_per_s)
        impls = [("reference", ref)]
        if (label in NATIVE_INSIDE or op in NATIVE_ONLY) and platform == "cpu" and cpu.available():
            impls.append(("native", run_with(KernelBackends("auto"))))
        pallas = _load_pallas(op)
        native = op in PALLAS_OPS and platform in PALLAS_OPS[op][1]
        if pallas is not None and native:
            impls.append(("pallas", jax.jit(lambda *a, _f=pallas, _kw=static: _f(*a, **_kw))))
        for impl, fn in impls:
            seconds = best_seconds(fn, operands, repeats=5)
            row = {"op": label, "impl": impl, "device": roof.device, "dtype": roof.dtype, "seconds": seconds,
                   "flops": flops, "bytes": nbytes, "roofline_seconds": bound, "utilisation": bound / seconds}
            print(f"{label:<26}{impl:<12}{seconds * 1e3:>8.2f}ms{flops / seconds / 1e9:>10.1f}"
                  f"{nbytes / seconds / 1e9:>9.1f}{bound * 1e3:>8.2f}ms{bound / seconds:>7.0%}")
            if args.output_file:
                with open(args.output_file, "a") as out:
                    out.write(json.dumps(row) + "\n")
        if op in NATIVE_ONLY:
            continue
        if pallas is None:
            print(f"{'':<26}pallas      not written yet")
        elif not native:
            note = "not native here (interpreted on CPU: no meaningful time)"
            if args.check_interpret:
                got = jax.jit(lambda *a, _f=pallas, _kw=static: _f(*a, interpret=True, **_kw))(*operands)
                want = ref(*operands)
                diff = max(float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
                           for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
                note += f"; interpreter max |kernel - reference| {diff:.2e}"
            print(f"{'':<26}pallas      {note}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
