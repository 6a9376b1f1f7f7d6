"""Per-op timings of the device ops (reference and Pallas kernel) vs the roofline measured in the same run.

For each op: best time, FLOP/s and bytes/s from XLA's `cost_analysis` of the reference (the work a good
kernel must do at least; for the experts, the useful work of the routed rows, since XLA:CPU's dense ragged_dot
counts every expert), and the share of the roofline. A Pallas kernel is timed too where it runs
natively (TPU; GPU for the portable ones); in the CPU interpreter its time means nothing, so on CPU only
its agreement with the reference is reported. On CPU, an op the reference routes into a native CPU kernel
(kernels/cpu: decode and prefill attention) is timed both ways: `reference` is plain jnp, `native` the C++
kernel; so is the 4-bit matmul, whose reference (dequantize, then XLA's dot) is what TPU and GPU run, and
the Gated DeltaNet and KDA decode steps, whose references gather the rows' states from the pool and scatter
them back.
Ops that update a state pool in place (the decode steps) are timed with the pool donated and threaded from
call to call, cycling over enough layers of it that the states come from memory, not the last-level cache.

    python -m bench.kernels [--quick] [--dtype float32|bfloat16] [--ops delta,kda] [--output-file F.jsonl]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.roofline import best_seconds, cost_of, measure_roofline
from kernels import cpu
from kernels.backend import CPU_OPS, PALLAS_OPS, KernelBackends, use_kernels
from kernels.quant.reference import quantize, to_panels
from serve import native_kernels
from serve.server_args import ServerArgs

# Ops whose reference calls a native CPU kernel (kernels/backend.py CPU_OPS) where one applies; ops that are
# themselves in CPU_OPS have a native CPU kernel and no Pallas one (the reference runs on other backends).
NATIVE_INSIDE = {"paged_attention (decode)", "paged_attention (decode, SmolLM2)",
                 "paged_attention (decode, shared prefix)", "paged_attention (prefill)",
                 "paged_attention (Qwen3-Next)"}
# Ops that update a state pool in place: op -> (index of the pool operand, index of the layer operand).
IN_PLACE = {"gated_delta_decode_update": (5, 6), "kda_decode_update": (5, 6)}
PACKAGES = {"ssd_prefill": "ssd", "gla_prefill": "gla", "experts_ffn": "moe",
            "paged_attention": "paged_attention", "qmatmul": "quant", "gated_delta_prefill": "delta_rule",
            "gated_delta_decode_update": "delta_rule", "kda_prefill": "delta_rule",
            "kda_decode_update": "delta_rule"}


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
    # SmolLM2's heads over a 1024-token prefix and 128 tokens of each sequence's own, 16 sequences: the
    # prefix's pages each sequence's own copy, then one copy shared by groups of 4 (the radix cache's pages
    # of a shared system prompt; attention.cc `run_shared` reads them once a group).
    sseqs, sprefix, sown, sgroup = (4, 128, 32, 2) if quick else (16, 1024, 128, 4)
    sp, so = sprefix // page, sown // page
    own_table = np.arange(sseqs * (sp + so)).reshape(sseqs, sp + so)
    shared_table = np.concatenate([np.repeat(np.arange(sseqs // sgroup * sp).reshape(-1, sp), sgroup, axis=0),
                                   sseqs * sp + np.arange(sseqs * so).reshape(sseqs, so)], axis=1)
    spool = (sseqs * (sp + so) + 1) * page

    def smol_decode(table):
        return (rand(sseqs, 9, 64), rand(1, spool, 3, 64), rand(1, spool, 3, 64), 0,
                jnp.asarray(1 + table, jnp.int32), jnp.full((sseqs,), sprefix + sown - 1, jnp.int32))

    def smol_useful(tokens):
        return {"flops": 4.0 * sseqs * 9 * (sprefix + sown) * 64,
                "bytes": float((2 * tokens * 3 * 64 + 2 * sseqs * 9 * 64) * dtype.itemsize)}
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
    # Decode rows through a 4-bit weight of SmolLM2's LM head shape (W[49152, 576]), with f32 and with int8
    # activations (`--activation-quantization int8`: qmatmul_i8.cc).
    hn = 4096 if quick else 49152
    head_w = np.asarray(rand(hn, qk, dt=jnp.float32, scale=0.05))
    hq, hscale, hzero = (jnp.asarray(a) for a in quantize(head_w, 4))
    hbytes = float(hq.nbytes + hscale.nbytes + hzero.nbytes)

    def head(rows: int):
        return (rand(rows, qk), hq, hscale, hzero), {"flops": 2.0 * rows * hn * qk, "bytes": hbytes}

    head1, head1_useful = head(1)
    head4, head4_useful = head(4)
    # The same weights in stored panels (kernels/quant/reference.py `to_panels`: what the loader lays out for
    # int8 activations where the library reads them in place; elsewhere the reference undoes the layout).
    stored = tuple(jnp.asarray(a) for a in to_panels(np.asarray(hq), np.asarray(hscale), np.asarray(hzero)))
    stored_prefill = (qmatmul[0], *(jnp.asarray(a) for a in to_panels(q, scale, zero)))
    panels = {"activations": "int8", "layout": "panels"}
    # Gated DeltaNet, one Qwen3-Next linear-attention layer: 32 value heads (q and k come L2-normalised and
    # already repeated from its 16 key heads, as the model passes them), Dk = Dv = 128, decays and write
    # strengths in the ranges a trained layer gives.
    hd_, dkd, dvd = 32, 128, 128

    def unit(*shape):  # L2-normalised rows
        x = rng.standard_normal(shape)
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), dtype)

    def decays(*shape):
        return jnp.asarray(-rng.uniform(0.01, 0.5, shape), jnp.float32)

    def betas(*shape):
        return jnp.asarray(rng.uniform(0.1, 0.9, shape), jnp.float32)

    delta_starts = np.arange(nb) % 2 == 0
    delta = (unit(nb, bs, hd_, dkd), unit(nb, bs, hd_, dkd), rand(nb, bs, hd_, dvd), decays(nb, bs, hd_),
             betas(nb, bs, hd_), jnp.zeros((nb, hd_, dkd, dvd), jnp.float32), jnp.asarray(delta_starts))
    # The work of the chunked (WY) form with the state carried from block to block, per block of L tokens and
    # head, triangles counted at half (the multiply-adds a kernel cannot skip; exps, masks and the beta and
    # decay scalings not counted): the strictly lower K K^T (L^2 Dk) and the causal Q K^T (L^2 Dk); the
    # triangular solve for both right-hand sides, beta v and beta exp(G) k (L^2 (Dv + Dk)); the corrections
    # u = w - kc S0 (2 L Dk Dv); the outputs, causal scores times u (L^2 Dv) plus q S0 (2 L Dk Dv); the state
    # leaving the block, exp(G_L) S0 + K_dec^T u (2 L Dk Dv). XLA's count of the reference is more: it also
    # forms each block's Dk x Dk transition (2 L Dk^2) and applies it in the scan (2 Dk^2 Dv), and counts the
    # full squares. Bytes: q, k, v read once, g and beta (f32), the init states of the blocks that start a
    # sequence, o and every block's final state written (f32).
    per_block = bs * bs * (3 * dkd + 2 * dvd) + 6 * bs * dkd * dvd
    delta_useful = {"flops": float(nb * hd_ * per_block),
                    "bytes": float(nb * bs * hd_ * (2 * dkd + dvd) * dtype.itemsize + 2 * nb * bs * hd_ * 4
                                   + (int(delta_starts.sum()) + nb) * hd_ * dkd * dvd * 4
                                   + nb * bs * hd_ * dvd * 4)}

    def delta_decode(rows: int, kda: bool = False):
        """A decode step of `rows` sequences on their states in a pool [layers, rows + 1, H, Dk, Dv] (slot 0:
        the padding rows' dummy), with enough layers that the states the calls cycle over (one layer each)
        are at least 128 MiB, four times this machine's 32 MiB L3, as the serving step finds them (the
        whole model's weights stream between two updates of one layer). `kda`: a decay per key channel."""
        state = dkd * dvd * 4  # one head's
        layers = max(2, -(-(128 << 20) // (rows * hd_ * state)))
        pool = rng.standard_normal((layers, rows + 1, hd_, dkd, dvd), dtype=np.float32) * np.float32(0.1)
        g = decays(rows, hd_, dkd) if kda else decays(rows, hd_)
        operands = (unit(rows, hd_, dkd), unit(rows, hd_, dkd), rand(rows, hd_, dvd), g,
                    betas(rows, hd_), jnp.asarray(pool), jnp.asarray(0, jnp.int32),
                    jnp.arange(1, rows + 1, dtype=jnp.int32))
        # Per row and head: k S (2 Dk Dv), S' = exp(g) S + k delta (3 Dk Dv), q S' (2 Dk Dv); the O(Dv) rest
        # (and KDA's O(Dk) decays) not counted. Bytes: each row's state read and written once (f32), q, k, v
        # in, g (f32, one per head or per key channel) and beta in, o out (f32).
        useful = {"flops": 7.0 * rows * hd_ * dkd * dvd,
                  "bytes": float(rows * hd_ * (2 * state + (2 * dkd + dvd) * dtype.itemsize
                                               + 4 * (dkd if kda else 1) + 4 + dvd * 4))}
        return operands, useful

    decode1, decode1_useful = delta_decode(1)
    decode8, decode8_useful = delta_decode(8)
    # Decode attention of Qwen3-Next's gated attention layers (16 query / 2 KV heads of 256), the only part of
    # its decode step that grows with the context: 8 sequences of 4096 tokens (1024 with --quick), pages of
    # 64 as bench/ssm.py's. The work counted as for "paged_attention (decode)".
    nseqs, nctx, npage, nkvh, nqh, nhd = (8, 1024 if quick else 4096, 64, 2, 16, 256)
    npages = nseqs * nctx // npage
    next_attention = (rand(nseqs, nqh, nhd), rand(1, (npages + 1) * npage, nkvh, nhd),
                      rand(1, (npages + 1) * npage, nkvh, nhd), 0,
                      jnp.asarray(1 + np.arange(npages).reshape(nseqs, -1), jnp.int32),
                      jnp.full((nseqs,), nctx - 1, jnp.int32))
    next_attention_useful = {"flops": 4.0 * nseqs * nqh * nctx * nhd,
                             "bytes": float((2 * nseqs * nctx * nkvh * nhd + 2 * nseqs * nqh * nhd)
                                            * dtype.itemsize)}
    # KDA, one Kimi-Linear (48B) layer (drawn last: the other ops keep their operands): 32 heads of 128, a
    # decay per key channel, the gated form's blocks. The work counted as the gated form's: the chunked form
    # (FLA's) folds the decays into the keys and queries before the same products; the decays are
    # elementwise (not counted) and g is read per key channel.
    knb, kbs = nb, bs
    kda_starts = np.arange(knb) % 2 == 0
    kda_prefill = (unit(knb, kbs, hd_, dkd), unit(knb, kbs, hd_, dkd), rand(knb, kbs, hd_, dvd),
                   decays(knb, kbs, hd_, dkd), betas(knb, kbs, hd_),
                   jnp.zeros((knb, hd_, dkd, dvd), jnp.float32), jnp.asarray(kda_starts))
    kda_per_block = kbs * kbs * (3 * dkd + 2 * dvd) + 6 * kbs * dkd * dvd
    kda_prefill_useful = {
        "flops": float(knb * hd_ * kda_per_block),
        "bytes": float(knb * kbs * hd_ * (2 * dkd + dvd) * dtype.itemsize + knb * kbs * hd_ * (dkd + 1) * 4
                       + (int(kda_starts.sum()) + knb) * hd_ * dkd * dvd * 4 + knb * kbs * hd_ * dvd * 4)}
    kda1, kda1_useful = delta_decode(1, kda=True)
    kda8, kda8_useful = delta_decode(8, kda=True)
    return {
        "ssd_prefill": ("ssd_prefill", ssd, {}, None),
        "gla_prefill": ("gla_prefill", gla, {"scale": dk**-0.5}, None),
        "experts_ffn": ("experts_ffn", moe, {}, moe_useful),
        "paged_attention (decode)": ("paged_attention", decode, {"page_size": page, "block_size": 1,
                                                                  "scale": hd**-0.5}, decode_useful),
        "paged_attention (decode, SmolLM2)": ("paged_attention", smol_decode(own_table),
                                              {"page_size": page, "block_size": 1, "scale": 64**-0.5},
                                              smol_useful(sseqs * (sprefix + sown))),
        "paged_attention (decode, shared prefix)": ("paged_attention", smol_decode(shared_table),
                                                    {"page_size": page, "block_size": 1, "scale": 64**-0.5},
                                                    smol_useful(sseqs // sgroup * sprefix + sseqs * sown)),
        "paged_attention (prefill)": ("paged_attention", prefill, {"page_size": page, "block_size": pbs,
                                                                    "scale": phd**-0.5}, prefill_useful),
        "qmatmul (4-bit, prefill)": ("qmatmul", qmatmul, {}, qmatmul_useful),
        "qmatmul (4-bit, 1 row)": ("qmatmul", head1, {}, head1_useful),
        "qmatmul (4-bit, 4 rows)": ("qmatmul", head4, {}, head4_useful),
        "qmatmul (4-bit, 1 row, int8 activations)": ("qmatmul", head1, {"activations": "int8"},
                                                     head1_useful),
        "qmatmul (4-bit, 4 rows, int8 activations)": ("qmatmul", head4, {"activations": "int8"},
                                                      head4_useful),
        "qmatmul (4-bit, prefill, bf16 activations)": ("qmatmul", qmatmul, {"activations": "bf16"},
                                                       qmatmul_useful),
        "qmatmul (4-bit, prefill, int8 activations)": ("qmatmul", qmatmul, {"activations": "int8"},
                                                       qmatmul_useful),
        "qmatmul (4-bit, 1 row, int8, stored panels)": ("qmatmul", (head1[0], *stored), panels, head1_useful),
        "qmatmul (4-bit, 4 rows, int8, stored panels)": ("qmatmul", (head4[0], *stored), panels,
                                                         head4_useful),
        "qmatmul (4-bit, prefill, int8, stored panels)": ("qmatmul", stored_prefill, panels, qmatmul_useful),
        "gated_delta_prefill": ("gated_delta_prefill", delta, {"scale": dkd**-0.5}, delta_useful),
        "gated_delta_decode (1 row)": ("gated_delta_decode_update", decode1, {"scale": dkd**-0.5},
                                       decode1_useful),
        "gated_delta_decode (8 rows)": ("gated_delta_decode_update", decode8, {"scale": dkd**-0.5},
                                        decode8_useful),
        "kda_prefill": ("kda_prefill", kda_prefill, {"scale": dkd**-0.5}, kda_prefill_useful),
        "kda_decode (1 row)": ("kda_decode_update", kda1, {"scale": dkd**-0.5}, kda1_useful),
        "kda_decode (8 rows)": ("kda_decode_update", kda8, {"scale": dkd**-0.5}, kda8_useful),
        "paged_attention (Qwen3-Next)": ("paged_attention", next_attention,
                                         {"page_size": npage, "block_size": 1, "scale": nhd**-0.5},
                                         next_attention_useful),
    }


def _reference(op: str):
    """The op's plain-jnp reference (kernels/<package>/reference.py)."""
    module = importlib.import_module(f"kernels.{PACKAGES[op]}.reference")
    return getattr(module, op) if hasattr(module, op) else getattr(module, f"{op}_reference")


def _dispatched(op: str):
    """The op as models call it (kernels/<package>): the implementation the active backends pick."""
    return getattr(importlib.import_module(f"kernels.{PACKAGES[op]}"), op)


def _in_place_seconds(fn, operands: tuple, pool_index: int, layer_index: int, repeats: int,
                      min_batch_s: float = 0.02) -> float:
    """Best wall time of one call of `fn(*operands) -> (out, pool)` that updates the pool operand in place:
    `fn` donates it and every call takes the pool the last one returned, on the next layer of it in turn.
    The operands' own pool is not touched (a copy is donated)."""
    args = list(operands)
    args[pool_index] = jnp.array(operands[pool_index], copy=True)
    layers = [jnp.asarray(i, jnp.int32) for i in range(operands[pool_index].shape[0])]
    calls_made = 0

    def call():
        nonlocal calls_made
        args[layer_index] = layers[calls_made % len(layers)]
        calls_made += 1
        out, args[pool_index] = fn(*args)
        return out

    for _ in range(2 * len(layers)):  # compiles, then warms every layer once
        call()
    jax.block_until_ready(args[pool_index])
    start = time.perf_counter()
    jax.block_until_ready(call())
    calls = max(len(layers), math.ceil(min_batch_s / max(time.perf_counter() - start, 1e-9)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [call() for _ in range(calls)]
        jax.block_until_ready((outs, args[pool_index]))
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _max_diff(got, want) -> float:
    """Largest |got - want| over the leaves of two results (in f32)."""
    return max(float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


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
    ap.add_argument("--ops", help="only the ops whose label contains one of these comma-separated words")
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
    print(f"{'op':<30}{'impl':<12}{'time':>10}{'GFLOP/s':>10}{'GB/s':>9}{'roofline':>10}{'util':>7}")
    words = [w.strip() for w in (args.ops or "").split(",") if w.strip()]
    for label, (op, operands, static, useful) in _cases(args.quick, dtype).items():
        if words and not any(w in label for w in words):
            continue
        in_place = IN_PLACE.get(op)

        def run_with(kernels: KernelBackends, fn, _kw=static, _in_place=in_place):
            def run(*a):
                with use_kernels(kernels):  # traced inside: the choice is made at trace time
                    return fn(*a, **_kw)

            return jax.jit(run, donate_argnums=(_in_place[0],) if _in_place else ())

        ref = run_with(KernelBackends("reference"), _reference(op))  # plain jnp throughout
        cost = cost_of(ref, *operands)
        flops, nbytes = cost["flops"] or 0.0, cost["bytes_accessed"] or 0.0
        if useful:
            flops, nbytes = useful["flops"], useful["bytes"]
        bound = max(flops / roof.matmul_flops_per_s, nbytes / roof.bandwidth_bytes_per_s)
        impls = [("reference", ref)]
        if platform == "cpu" and cpu.available():
            if label in NATIVE_INSIDE:  # the reference picks the native kernel inside
                impls.append(("native", run_with(KernelBackends("auto"), _reference(op))))
            elif op in CPU_OPS:
                impls.append(("native", run_with(KernelBackends("auto"), _dispatched(op))))
        pallas = _load_pallas(op)
        native = op in PALLAS_OPS and platform in PALLAS_OPS[op][1]
        if pallas is not None and native:
            impls.append(("pallas", jax.jit(lambda *a, _f=pallas, _kw=static: _f(*a, **_kw))))
        for impl, fn in impls:
            if in_place:
                seconds = _in_place_seconds(fn, operands, *in_place, repeats=5)
            else:
                seconds = best_seconds(fn, operands, repeats=5)
            row = {"op": label, "impl": impl, "device": roof.device, "dtype": roof.dtype, "seconds": seconds,
                   "flops": flops, "bytes": nbytes, "roofline_seconds": bound, "utilisation": bound / seconds,
                   "xla_flops": cost["flops"], "xla_bytes": cost["bytes_accessed"]}
            print(f"{label:<30}{impl:<12}{seconds * 1e3:>8.2f}ms{flops / seconds / 1e9:>10.1f}"
                  f"{nbytes / seconds / 1e9:>9.1f}{bound * 1e3:>8.2f}ms{bound / seconds:>7.0%}")
            if impl != "reference":
                # The same operands through both (a donated pool is copied first, so neither sees the
                # other's update).
                fresh = (lambda: [jnp.array(x, copy=True) if i == in_place[0] else x
                                  for i, x in enumerate(operands)]) if in_place else (lambda: list(operands))
                diff = _max_diff(fn(*fresh()), ref(*fresh()))
                print(f"{'':<30}{impl:<12}max |{impl} - reference| {diff:.2e}")
            if args.output_file:
                with open(args.output_file, "a") as out:
                    out.write(json.dumps(row) + "\n")
        if useful and cost["flops"]:
            print(f"{'':<30}{'':<12}(counted: the work the op must do; XLA's count of the reference "
                  f"{cost['flops'] / 1e9:.2f} GFLOP, {(cost['bytes_accessed'] or 0) / 1e6:.1f} MB)")
        if op in CPU_OPS:  # no Pallas kernel: the native one is the kernel
            continue
        if pallas is None:
            print(f"{'':<30}pallas      not written yet")
        elif not native:
            note = "not native here (interpreted on CPU: no meaningful time)"
            if args.check_interpret:
                got = jax.jit(lambda *a, _f=pallas, _kw=static: _f(*a, interpret=True, **_kw))(*operands)
                note += f"; interpreter max |kernel - reference| {_max_diff(got, ref(*operands)):.2e}"
            print(f"{'':<30}pallas      {note}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
