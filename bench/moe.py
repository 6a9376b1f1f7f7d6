"""Mixture-of-experts serving cost: a Qwen3-MoE-shaped and a MiniMax-shaped random model, and their MoE layer.

End to end, each model (random float32 weights written by transformers `from_config` + `save_pretrained`
and loaded by our loader) runs on the ModelRunner as in bench/one_batch.py: prefill of `--input-len` tokens
per sequence, then greedy decode, at each batch size. The MoE block alone (`kernels.moe.moe_ffn` with the
model's shapes, router matmul included, jitted) is timed at a decode, a batch-32 and a prefill token count
and compared with a roofline measured in the same run: the bytes it must move (the router and the experts
the tokens actually chose, read once, plus the input and output activations) over the measured bandwidth,
or its useful FLOPs (router, and top_k experts per token) over the measured matmul peak, whichever is
larger. A stage breakdown (route, sort, each ragged_dot, combine) shows where the layer's time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.one_batch import run_batch
from bench.roofline import Roofline, best_seconds, cost_of, measure_roofline
from kernels.moe import moe_ffn, route
from kernels.moe.reference import ACTIVATIONS
from models.loader import load_model
from runtime.buckets import Buckets
from runtime.runner import ModelRunner, RunnerConfig
from serve import native_kernels
from serve.server_args import ServerArgs

# Shapes chosen so the full run takes a few minutes on a 2-core CPU while the MoE layer stays memory-sized:
# hidden 1024 and 8 layers with 100 MiB of experts per layer (float32), far more than the 2 MiB L2 per core,
# about 1.2 GiB of weights per model. Qwen3-30B-A3B's ratios, scaled down: 16 experts of 512 (top 2, so an
# eighth of the expert weights is active per token), q/k norm, 128-wide heads with 4 KV heads.
QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    intermediate_size=2048,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# MiniMax-Text-01's layout: seven Lightning (linear attention) layers, then one softmax attention layer,
# MoE in every layer with top-2 of 32 experts (a sixteenth active). The experts are 256 wide, so a layer
# holds the same 100 MiB of experts as the Qwen3-MoE shape but each token uses half as much of it.
MINIMAX = dict(
    architectures=["MiniMaxForCausalLM"],
    model_type="minimax",
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 7 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    num_local_experts=32,
    num_experts_per_tok=2,
    intermediate_size=256,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {"qwen3_moe": QWEN3_MOE, "minimax": MINIMAX}
# --quick: the same architectures a quarter of the size (and fewer tokens), for a run of about a minute.
QUICK = dict(vocab_size=8000, hidden_size=512, num_hidden_layers=4)
QUICK_MINIMAX = dict(layer_types=["linear_attention"] * 3 + ["full_attention"])


def save_random_checkpoint(hf: dict[str, Any], path: str, seed: int) -> None:
    """Writes a float32 model of config `hf` with transformers' random initialisation to `path`."""
    import torch
    import transformers

    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    cfg = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(path)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """The MoE layer of a model: hidden D, expert width F, E experts, top_k, renormalised weights, act."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    normalize_topk: bool
    act: str

    @classmethod
    def of(cls, cfg) -> MoeShape:
        """Of a models.moe.MoeConfig (expert width `moe_intermediate_size`) or a MiniMaxConfig (its
        `intermediate_size`; MiniMax always renormalises the top-k weights)."""
        return cls(
            hidden=cfg.hidden_size,
            intermediate=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            normalize_topk=getattr(cfg, "norm_topk_prob", True),
            act=getattr(cfg, "hidden_act", "silu"),
        )

    def expert_bytes(self, itemsize: int) -> int:
        return 3 * self.hidden * self.intermediate * itemsize  # gate, up and down of one expert

    def router_bytes(self, itemsize: int) -> int:
        return self.hidden * self.num_experts * itemsize

    def useful_flops(self, num_tokens: int) -> int:
        """Router plus the top_k chosen experts' three matmuls per token (the act and combine are free)."""
        d, f, e, k = self.hidden, self.intermediate, self.num_experts, self.top_k
        return 2 * num_tokens * (d * e + k * 3 * d * f)


def moe_weights(shape: MoeShape, dtype, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(router f[D, E], gate_up f[E, D, 2F], down f[E, F, D]) with HF's N(0, 0.02) initialisation."""
    rng = np.random.default_rng(seed)
    d, f, e = shape.hidden, shape.intermediate, shape.num_experts
    return tuple(
        jnp.asarray(rng.normal(0, 0.02, s).astype(np.float32), dtype)
        for s in ((d, e), (e, d, 2 * f), (e, f, d))
    )


def moe_layer(shape: MoeShape):
    """The timed MoE block: router matmul, then kernels.moe.moe_ffn; weights are arguments, not constants."""

    def layer(x, w_router, w_gate_up, w_down):
        return moe_ffn(
            x,
            x @ w_router,
            w_gate_up,
            w_down,
            top_k=shape.top_k,
            scoring="softmax",
            normalize_topk=shape.normalize_topk,
            act=shape.act,
        )

    return jax.jit(layer)


def moe_stages(shape: MoeShape) -> list[tuple[str, Any]]:
    """moe_ffn taken apart (the same steps as kernels/moe/reference.py), one function per stage.

    A stage is called as `stage(weights, *outputs of the previous stage)`, weights = (router, gate_up,
    down), the first stage on (x,); so each can be jitted and timed alone. Their sum exceeds the fused
    layer by whatever fusion across stages saves.
    """
    k, act = shape.top_k, ACTIVATIONS[shape.act]
    num_experts = shape.num_experts

    def routing(w, x):
        weights, experts = route(x @ w[0], top_k=k, scoring="softmax", normalize_topk=shape.normalize_topk)
        return x, weights, experts

    def sort(w, x, weights, experts):
        flat = experts.reshape(-1)  # i32[T*k]
        order = jnp.argsort(flat, stable=True)  # i32[T*k]
        group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # i32[E]
        return x.astype(w[1].dtype)[order // k], order, group_sizes, weights

    def gate_up(w, xs, order, group_sizes, weights):
        h = jax.lax.ragged_dot(xs, w[1], group_sizes, preferred_element_type=jnp.float32)  # f32[T*k, 2F]
        return h, order, group_sizes, weights

    def activation(w, h, order, group_sizes, weights):
        gate, up = jnp.split(h, 2, axis=-1)
        return (act(gate) * up).astype(w[2].dtype), order, group_sizes, weights

    def down(w, h, order, group_sizes, weights):
        ys = jax.lax.ragged_dot(h, w[2], group_sizes, preferred_element_type=jnp.float32)  # f32[T*k, D]
        return ys, order, weights

    def combine(w, ys, order, weights):
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(weights.shape[0], k, -1)
        return (weights[:, :, None] * y).sum(axis=1)

    return [
        ("route", routing),
        ("sort+gather", sort),
        ("ragged_dot gate_up", gate_up),
        ("act", activation),
        ("ragged_dot down", down),
        ("unpermute+combine", combine),
    ]


def expert_relayout(w_gate_up: jax.Array, w_down: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The copies XLA:CPU's ragged_dot makes of all the experts on every call, done alone.

    On CPU, jax lowers ragged_dot densely: the rows are masked into [E, rows, K] and contracted with the
    weights over (K, E), so the weights are transposed to [K, E, N] (read and written once) before one
    dense matmul over every expert (E times the useful FLOPs).
    """
    two_f, hidden = w_gate_up.shape[2], w_down.shape[2]
    return (
        jnp.transpose(w_gate_up, (1, 0, 2)).reshape(-1, two_f),  # f[D * E, 2F]
        jnp.transpose(w_down, (1, 0, 2)).reshape(-1, hidden),  # f[F * E, D]
    )


def gathered_experts_layer(shape: MoeShape):
    """Not the kernel: a reference point that reads only the chosen experts (a per-token gather of their
    weights, then batched matmuls). Cheap when T * top_k is small; it copies T * top_k experts."""

    def layer(x, w_router, w_gate_up, w_down):
        weights, experts = route(
            x @ w_router, top_k=shape.top_k, scoring="softmax", normalize_topk=shape.normalize_topk
        )
        h = jnp.einsum(
            "td,tkdf->tkf", x, w_gate_up[experts], preferred_element_type=jnp.float32
        )  # [T, k, 2F]
        gate, up = jnp.split(h, 2, axis=-1)
        y = jnp.einsum("tkf,tkfd->tkd", ACTIVATIONS[shape.act](gate) * up, w_down[experts])  # f32[T, k, D]
        return (weights[:, :, None] * y).sum(axis=1)

    return jax.jit(layer)


def bench_moe_layer(name: str, shape: MoeShape, dtype, token_counts: list[int], seed: int) -> list[dict]:
    """Times the MoE block at each token count; returns one record per count with its bytes and FLOPs."""
    itemsize = dtype.itemsize
    weights = moe_weights(shape, dtype, seed)
    layer, stages, gathered = moe_layer(shape), moe_stages(shape), gathered_experts_layer(shape)
    relayout_ms = best_seconds(jax.jit(expert_relayout), weights[1:], 3) * 1e3
    records = []
    for num_tokens in token_counts:
        rng = np.random.default_rng(seed + num_tokens)
        x = jnp.asarray(rng.normal(0, 1, (num_tokens, shape.hidden)).astype(np.float32), dtype)  # f[T, D]
        args = (x, *weights)
        repeats = 5 if num_tokens <= 64 else 3
        seconds = best_seconds(layer, args, repeats)
        _, experts = route(
            x @ weights[0], top_k=shape.top_k, scoring="softmax", normalize_topk=shape.normalize_topk
        )
        touched = len(np.unique(np.asarray(experts)))
        stage_ms, stage_in = {}, (x,)
        for stage, fn in stages:
            jitted = jax.jit(fn)
            stage_ms[stage] = best_seconds(jitted, (weights, *stage_in), repeats) * 1e3
            out = jitted(weights, *stage_in)
            stage_in = out if isinstance(out, tuple) else (out,)
        xla_flops = cost_of(layer, *args)["flops"]
        record = {
            "kind": "moe_layer",
            "model": name,
            "tokens": num_tokens,
            "hidden": shape.hidden,
            "intermediate": shape.intermediate,
            "num_experts": shape.num_experts,
            "top_k": shape.top_k,
            "experts_touched": touched,
            "ms": seconds * 1e3,
            # x read and the f32 output written once, besides the weights.
            "bytes": touched * shape.expert_bytes(itemsize)
            + shape.router_bytes(itemsize)
            + x.nbytes
            + num_tokens * shape.hidden * 4,
            "flops": shape.useful_flops(num_tokens),
            "xla_flops_over_useful": None
            if xla_flops is None
            else xla_flops / shape.useful_flops(num_tokens),
            "stage_ms": stage_ms,
            "expert_relayout_ms": relayout_ms,
        }
        if num_tokens == 1:
            record["gathered_experts_ms"] = best_seconds(gathered, args, repeats) * 1e3
        records.append(record)
    return records


def utilisation(r: dict, shape: MoeShape, roof: Roofline) -> dict:
    """Roofline figures of MoE-layer record `r`: the bound, x the roofline time, bandwidth and FLOP use."""
    bytes_s, flops_s = r["bytes"] / roof.bandwidth_bytes_per_s, r["flops"] / roof.matmul_flops_per_s
    seconds = r["ms"] / 1e3
    return {
        "device": roof.device,
        "dtype": roof.dtype,
        "bandwidth_gb_s": roof.bandwidth_bytes_per_s / 1e9,
        "matmul_gflop_s": roof.matmul_flops_per_s / 1e9,
        "bound": "bandwidth" if bytes_s >= flops_s else "FLOPs",
        "roofline_ms": max(bytes_s, flops_s) * 1e3,
        "x_roofline": seconds / max(bytes_s, flops_s),
        "bw_util": r["bytes"] / seconds / roof.bandwidth_bytes_per_s,
        "flop_util": r["flops"] / seconds / roof.matmul_flops_per_s,
        # Every expert's weights read once: what XLA:CPU's ragged_dot does (it runs every expert densely).
        "all_experts_read_ms": shape.num_experts
        * shape.expert_bytes(jnp.dtype(roof.dtype).itemsize)
        / roof.bandwidth_bytes_per_s
        * 1e3,
    }


def bench_model(name: str, hf: dict[str, Any], args, dtype, seed: int) -> tuple[Any, list[dict]]:
    """Saves, loads and runs the model at each batch size; returns (config, one record per batch size)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bench_moe_{name}_") as path:
        save_random_checkpoint(hf, path, seed)
        cfg, model = load_model(path, dtype)
    load_s = time.perf_counter() - start
    batch_sizes = args.batch_sizes
    context = args.input_len + args.output_len
    buckets = Buckets.make(
        max_running_requests=max(batch_sizes),
        chunked_prefill_size=args.chunked_prefill_size,
        prefill_block_size=args.prefill_block_size,
        max_context_len=context,
        page_size=args.page_size,
    )
    num_pages = max(batch_sizes) * -(-context // args.page_size) + 1
    runner = ModelRunner(
        model, cfg, RunnerConfig(args.page_size, num_pages, max(batch_sizes), buckets, cfg.vocab_size), dtype
    )
    del model
    print(
        f"{name}: {cfg.num_params / 1e6:.1f} M params, weights {runner.weight_bytes / 2**20:.0f} MiB "
        f"(saved by transformers and loaded in {load_s:.1f} s)"
    )
    start = time.perf_counter()
    for b in batch_sizes:
        run_batch(runner, cfg, args, b, warmup=True)
    runner.warmed_up = True
    compile_s = time.perf_counter() - start
    records = []
    for b in batch_sizes:
        r = run_batch(runner, cfg, args, b, warmup=False)
        step = statistics.median(r["step_s"])
        records.append(
            {
                "kind": "model",
                "model": name,
                "architecture": cfg.architecture,
                "batch": b,
                "input_len": args.input_len,
                "decode_steps": args.output_len,
                "num_params": cfg.num_params,
                "weight_bytes": runner.weight_bytes,
                "compile_s": compile_s,
                "prefill_s": r["prefill_s"],
                "prefill_tok_s": b * args.input_len / r["prefill_s"],
                "decode_step_ms": step * 1e3,
                "decode_tok_s": b / step,
                "decode_step_ms_min": min(r["step_s"]) * 1e3,
            }
        )
    if runner.compiles_after_warmup:
        print(f"warning: {runner.compiles_after_warmup} compiles after warm-up were timed")
    return cfg, records


def print_tables(layers: list[dict], models: list[dict]) -> None:
    print(
        f"\nMoE layer alone (router + moe_ffn, jitted):\n{'model':>10} {'T':>4} {'touched':>7} | {'ms':>8} "
        f"{'roof ms':>8} {'bound':>9} {'x roof':>7} {'BW%':>6} {'FLOP%':>6} | {'all-E ms':>8} {'XLA/use':>7}"
    )
    for r in layers:
        ratio = r["xla_flops_over_useful"]
        print(
            f"{r['model']:>10} {r['tokens']:>4} {r['experts_touched']:>3}/{r['num_experts']:<3} | "
            f"{r['ms']:>8.2f} {r['roofline_ms']:>8.3f} {r['bound']:>9} {r['x_roofline']:>7.1f} "
            f"{100 * r['bw_util']:>5.1f}% {100 * r['flop_util']:>5.1f}% | {r['all_experts_read_ms']:>8.2f} "
            f"{'n/a' if ratio is None else f'{ratio:.1f}x':>7}"
        )
    print(
        "touched: experts chosen by at least one token; roof ms: max(bytes / bandwidth, useful FLOPs / peak),"
        " bytes = router + touched experts + x and y; all-E ms: every expert's weights read once at the "
        "measured bandwidth; XLA/use: XLA cost_analysis FLOPs over the useful FLOPs"
    )
    stages = list(layers[0]["stage_ms"])
    print(
        "\nMoE layer stages, ms (each jitted on its own):\n"
        + f"{'model':>10} {'T':>4} | "
        + " ".join(f"{s:>18}" for s in stages)
        + f" | {'sum':>8} {'fused':>8} {'relayout':>8} {'gathered':>9}"
    )
    for r in layers:
        gathered = r.get("gathered_experts_ms")
        print(
            f"{r['model']:>10} {r['tokens']:>4} | "
            + " ".join(f"{r['stage_ms'][s]:>18.2f}" for s in stages)
            + f" | {sum(r['stage_ms'].values()):>8.2f} {r['ms']:>8.2f} {r['expert_relayout_ms']:>8.2f} "
            + (f"{gathered:>9.2f}" if gathered is not None else f"{'':>9}")
        )
    print(
        "relayout: the transposed copy of every expert's weights that XLA:CPU's ragged_dot makes per call, "
        "alone; gathered: not the kernel, route then gather the chosen experts' weights, batched matmuls"
    )
    print(
        f"\nEnd to end (ModelRunner, random float32 weights):\n{'model':>10} {'batch':>5} | {'prefill s':>9} "
        f"{'tok/s':>8} | {'step ms':>8} {'tok/s':>8} {'MoE share':>9}"
    )
    for r in models:
        print(
            f"{r['model']:>10} {r['batch']:>5} | {r['prefill_s']:>9.2f} {r['prefill_tok_s']:>8.0f} | "
            f"{r['decode_step_ms']:>8.1f} {r['decode_tok_s']:>8.1f} {100 * r['moe_share_est']:>8.0f}%"
        )
    print(
        "MoE share: the MoE layer's best time alone at the decode batch's token count times the layer count, "
        "over the fastest decode step (an estimate)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="qwen3_moe,minimax", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=8, help="decode steps timed after the prefill")
    p.add_argument("--layer-tokens", default="1,32,512", help="token counts of the MoE-layer timings")
    p.add_argument("--prefill-block-size", type=int, default=64, help="= the Lightning attention chunk")
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="quarter-size models, 64-token prompts, 4 decode steps"
    )
    p.add_argument("--output-file", default=None, help="append one JSON line per layer timing and per run")
    args = p.parse_args()
    # The native CPU kernels take CXX, XLASERVE_CPU_KERNELS, ... as the server does (serve/native_kernels.py).
    native_kernels.configure(ServerArgs().resolved_cache_dir())
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    token_counts = [int(t) for t in args.layer_tokens.split(",")]
    names = args.models.split(",")
    unknown = set(names) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown --models {sorted(unknown)}; known: {', '.join(MODELS)}")
    if args.quick:
        args.input_len, args.output_len, token_counts = 64, 4, sorted({*args.batch_sizes, 128})
    dtype = jnp.dtype(args.dtype)
    run_start = time.perf_counter()

    before = measure_roofline(dtype)
    # The machine may be shared: the load average says how much the figures below were disturbed.
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the start")
    print(
        f"device {before.device}, jax {jax.__version__}, dtype {dtype.name}; roofline before: read "
        f"{before.bandwidth_bytes_per_s / 1e9:.1f} GB/s, matmul {before.matmul_flops_per_s / 1e9:.1f} GFLOP/s"
    )
    shapes, models = {}, []
    for name in names:
        hf = dict(MODELS[name])
        if args.quick:
            hf.update(QUICK, **(QUICK_MINIMAX if name == "minimax" else {}))
        cfg, records = bench_model(name, hf, args, dtype, args.seed)
        shapes[name] = (MoeShape.of(cfg), cfg.num_layers)
        models += records
    layers = []
    # The layer timings run after the models, with the roofline measured around them.
    for name, (shape, _) in shapes.items():
        layers += bench_moe_layer(name, shape, dtype, token_counts, args.seed)
    after = measure_roofline(dtype)
    # The better of the two: on a shared machine a contended measurement would flatter the utilisation.
    roof = before._replace(
        bandwidth_bytes_per_s=max(before.bandwidth_bytes_per_s, after.bandwidth_bytes_per_s),
        matmul_flops_per_s=max(before.matmul_flops_per_s, after.matmul_flops_per_s),
    )
    print(
        f"roofline after: read {after.bandwidth_bytes_per_s / 1e9:.1f} GB/s, matmul "
        f"{after.matmul_flops_per_s / 1e9:.1f} GFLOP/s; utilisation is against the better of the two"
    )
    for r in layers:
        r.update(utilisation(r, shapes[r["model"]][0], roof))
    for r in models:
        num_layers = shapes[r["model"]][1]
        layer_ms = {t["tokens"]: t["ms"] for t in layers if t["model"] == r["model"]}
        # Best against best: both timings are minima over repeats, the least disturbed by other load.
        r["moe_share_est"] = (
            layer_ms[r["batch"]] * num_layers / r["decode_step_ms_min"]
            if r["batch"] in layer_ms
            else float("nan")
        )
        r.update(
            device=roof.device,
            dtype=roof.dtype,
            bandwidth_gb_s=roof.bandwidth_bytes_per_s / 1e9,
            matmul_gflop_s=roof.matmul_flops_per_s / 1e9,
        )
    print_tables(layers, models)
    print(
        f"took {time.perf_counter() - run_start:.0f} s; "
        f"load average {os.getloadavg()[0]:.1f} (1 min) at the end"
    )
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in layers + models:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
