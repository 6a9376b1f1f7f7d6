"""Accuracy of weight quantization on a real model: perplexity on a fixed text and greedy agreement on chat.

    python -m bench.quant_accuracy --modes fp32,bf16,int8,int4,q4_1 --tokens 4096 --new-tokens 64

Each mode is one in-process Engine (started, measured, shut down before the next) with these server flags:
fp32 `--dtype float32`, bf16 `--dtype bfloat16`, int8 / int4 `--quantization int8 | int4` (every Linear
layer, the embedding and the LM head requantized by our NumPy quantizer from the checkpoint's fp32) and q4_1
`--quantization auto` (a GGUF file's own Q4_1 / Q8_0 blocks kept as they are); the quantized modes compute
in `--quant-dtype`. The text is the English documentation CPython ships (`pydoc_data.topics`), topics in
sorted order, cut at exactly `--tokens` tokens and scored as one prompt: every token after the first is
predicted from all the tokens before it. Perplexity = exp(mean negative log-likelihood of those tokens).
Greedy agreement: `--num-prompts` fixed chat prompts (the chat template applied as the server's chat
endpoint does) decoded greedily, each mode's tokens against fp32's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from typing import Any, NamedTuple

# mode -> (dtype, quantization, kv_cache_dtype) as the server's flags; None dtype: --quant-dtype.
MODES: dict[str, tuple[str | None, str, str]] = {
    "fp32": ("float32", "none", "auto"),
    "bf16": ("bfloat16", "none", "auto"),
    "int8": (None, "int8", "auto"),
    "int4": (None, "int4", "auto"),
    "q4_1": (None, "auto", "auto"),
    "q4_1_kv_bf16": (None, "auto", "bfloat16"),  # the file's blocks and a bf16 KV cache
    "q4_1_bf16": ("bfloat16", "auto", "bfloat16"),  # and bf16 activations (AMX tiles where the CPU has them)
    "q4_1_a8": (None, "auto", "bfloat16"),  # and inputs rounded to int8 per group (ACTIVATIONS)
    "q4_1_abf16": (None, "auto", "bfloat16"),  # and the products' inputs rounded to bf16 (ACTIVATIONS)
}
# modes whose products round their inputs (--activation-quantization)
ACTIVATIONS = {"q4_1_a8": "int8", "q4_1_abf16": "bf16"}
REFERENCE = "fp32"

CHAT_PROMPTS = [
    "What is the capital of Australia, and why was it chosen?",
    "Explain photosynthesis to a ten-year-old in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is 17 times 23? Show your working.",
    "Give me three tips for improving my sleep.",
    "Translate into French: 'The library opens at nine o'clock tomorrow morning.'",
    "Write a haiku about autumn rain.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do vaccines train the immune system?",
    "Suggest a name for a small bakery that specializes in sourdough bread.",
    "A train leaves at 3:15 pm and the trip takes 2 hours 50 minutes. When does it arrive?",
    "List the planets of the solar system in order from the sun.",
    "Write a short, polite email declining a meeting invitation.",
    "What causes the seasons on Earth?",
    "Explain what a hash table is and when you would use one.",
    "Give a recipe for a simple tomato pasta sauce.",
    "What are the main differences between renewable and non-renewable energy?",
    "Write a SQL query that returns the ten most recent orders from a table named orders.",
    "Tell me a fun fact about octopuses.",
]


# ---- inputs ----------------------------------------------------------------------------------------------

def fixed_text_ids(tokenizer, num_tokens: int) -> tuple[list[int], int, int]:
    """The first `num_tokens` tokens of CPython's documentation topics (`pydoc_data.topics`, sorted by key,
    joined by blank lines), how many topics that took and how many there are. Raises if all of them are too
    short."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    text, ids = "", []
    for i, key in enumerate(keys, 1):
        text += ("\n\n" if text else "") + topics[key]
        # Roughly 4 characters a token: encode only once the text is likely long enough (and at the end).
        if len(text) >= 3 * num_tokens or i == len(keys):
            ids = tokenizer.encode(text)
            if len(ids) >= num_tokens:
                return ids[:num_tokens], i, len(keys)
    raise ValueError(f"pydoc_data.topics holds only {len(ids)} tokens, fewer than {num_tokens}")


def chat_prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user message, rendered as `Engine.chat` and the chat endpoint do."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]


# ---- measurements ----------------------------------------------------------------------------------------

def prompt_logprobs(engine, ids: list[int]) -> list[float]:
    """Log-probability of every token of `ids` after the first, given all the tokens before it."""
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=0)
    lps = out["meta_info"]["input_token_logprobs"]
    if len(lps) != len(ids) or [t for _, t in lps] != ids:
        raise RuntimeError(f"got {len(lps)} prompt logprobs for {len(ids)} tokens")
    return [lp for lp, _ in lps[1:]]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_outputs(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy output ids of `prompts`, submitted as one batch (at most `new_tokens` each; EOS stops)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(outputs token-identical to `ref`'s, mean over prompts of common prefix / the longer output)."""
    same = sum(r == g for r, g in zip(ref, got, strict=True))
    fracs = [common_prefix(r, g) / max(len(r), len(g), 1) for r, g in zip(ref, got, strict=True)]
    return same, sum(fracs) / len(fracs)


class ModeResult(NamedTuple):
    mode: str
    dtype: str
    quantization: str
    logprobs: list[float]
    outputs: list[list[int]]
    load_s: float  # Engine start minus precompile: model load (and quantization) and pool sizing
    precompile_s: float
    weight_mib: float
    ppl_s: float  # scoring the text
    greedy_s: float  # the chat prompts' greedy decode


def run_mode(mode: str, model: str | None, quant_dtype: str, text_ids: list[int],
             chat_ids: list[list[int]], new_tokens: int, engine_kwargs: dict[str, Any]) -> ModeResult:
    """Starts one Engine for `mode`, scores the text, decodes the chat prompts, shuts it down."""
    from serve import Engine

    dtype, quantization, kv_cache_dtype = MODES[mode]
    dtype = dtype or quant_dtype
    engine = Engine(model=model, in_process=True, dtype=dtype, quantization=quantization,
                    kv_cache_dtype=kv_cache_dtype, activation_quantization=ACTIVATIONS.get(mode, "none"),
                    **engine_kwargs)
    try:
        start = time.perf_counter()
        logprobs = prompt_logprobs(engine, text_ids)
        ppl_s = time.perf_counter() - start
        start = time.perf_counter()
        outputs = greedy_outputs(engine, chat_ids, new_tokens)
        greedy_s = time.perf_counter() - start
        return ModeResult(mode, dtype, quantization, logprobs, outputs,
                          engine.startup_seconds - engine.precompile_seconds, engine.precompile_seconds,
                          engine.runner.weight_bytes / 2**20, ppl_s, greedy_s)
    finally:
        engine.shutdown()


def summarize(results: list[ModeResult]) -> list[dict[str, Any]]:
    """One row per mode: perplexity and, against the fp32 result (if run), its delta, the mean absolute
    difference of the per-token logprobs and the greedy agreement."""
    ref = next((r for r in results if r.mode == REFERENCE), None)
    rows = []
    for r in results:
        row = {"mode": r.mode, "dtype": r.dtype, "quantization": r.quantization,
               "perplexity": perplexity(r.logprobs), "scored_tokens": len(r.logprobs),
               "load_s": r.load_s, "precompile_s": r.precompile_s, "weight_mib": r.weight_mib,
               "ppl_s": r.ppl_s, "greedy_s": r.greedy_s, "num_prompts": len(r.outputs),
               "mean_output_tokens": sum(map(len, r.outputs)) / len(r.outputs)}
        if ref is not None and r is not ref:
            row["delta_ppl"] = row["perplexity"] - perplexity(ref.logprobs)
            row["mean_abs_dlogprob"] = sum(abs(a - b) for a, b in zip(r.logprobs, ref.logprobs, strict=True)
                                           ) / len(r.logprobs)
            row["greedy_identical"], row["prefix_fraction"] = agreement(ref.outputs, r.outputs)
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | flags | perplexity | delta vs fp32 | mean abs delta logprob | greedy identical | "
        "mean common-prefix fraction | load s | precompile s | weights MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = MODES[r["mode"]][2]
        flags = (f"`--dtype {r['dtype']}" + ("" if r["quantization"] == "none" else
                                              f" --quantization {r['quantization']}")
                 + ("" if kv == "auto" else f" --kv-cache-dtype {kv}")
                 + (f" --activation-quantization {ACTIVATIONS[r['mode']]}"
                    if r["mode"] in ACTIVATIONS else "")
                 + "`")
        if "delta_ppl" in r:
            pct = 100 * r["delta_ppl"] / (r["perplexity"] - r["delta_ppl"])
            vs = (f"{r['delta_ppl']:+.3f} ({pct:+.2f}%) | {r['mean_abs_dlogprob']:.4f} | "
                  f"{r['greedy_identical']}/{r['num_prompts']} | {r['prefix_fraction']:.3f}")
        else:
            vs = "(reference) | - | - | -"
        lines.append(f"| {r['mode']} | {flags} | {r['perplexity']:.3f} | {vs} | {r['load_s']:.1f} | "
                     f"{r['precompile_s']:.1f} | {r['weight_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--model", default=None, help="path or alias (default: the server's default model)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the fixed text scored (one prompt)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens at most per chat prompt")
    p.add_argument("--num-prompts", type=int, default=len(CHAT_PROMPTS),
                   help=f"the first N of the {len(CHAT_PROMPTS)} chat prompts")
    p.add_argument("--quant-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="--dtype of the int8, int4 and q4_1 modes (activations, unquantized weights)")
    p.add_argument("--chunked-prefill-size", type=int, default=512, help="as the server's flag")
    p.add_argument("--kernel-backend", default="auto", help="as the server's flag")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: what the text or the chat batch needs)")
    p.add_argument("--output-file", default=None, help="append one JSON line per mode")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise ValueError(f"--modes {args.modes!r}: each of {', '.join(MODES)} at most once")
    if not 1 <= args.num_prompts <= len(CHAT_PROMPTS) or args.tokens < 2 or args.new_tokens < 1:
        raise ValueError(f"{args.num_prompts=} must be in [1, {len(CHAT_PROMPTS)}], {args.tokens=} >= 2, "
                         f"{args.new_tokens=} >= 1")
    wall = time.perf_counter()

    from serve import native_kernels
    from serve.model_source import resolve_model
    from serve.server_args import ServerArgs
    from serve.tokenizer import load_tokenizer

    cache_dir = ServerArgs().resolved_cache_dir()
    native_kernels.configure(cache_dir)
    model = resolve_model(args.model, cache_dir)
    tokenizer = load_tokenizer(model, cache_dir)
    text_ids, used, num_topics = fixed_text_ids(tokenizer, args.tokens)
    chat_ids = chat_prompt_ids(tokenizer, CHAT_PROMPTS[: args.num_prompts])
    page = 16

    def pages(n: int) -> int:
        return -(-n // page) * page

    context = pages(max(args.tokens + 1, max(map(len, chat_ids)) + args.new_tokens))
    # The KV pool holds what the run needs, not the server's default (a tenth of RAM): XLA on CPU upcasts a
    # bfloat16 scatter to float32, so every KV write (write_kv, twice a layer per step) converts the whole
    # pool to float32 and back; a bf16 step costs seconds with the default pool. The pool's size does not
    # change any number measured here.
    pool = args.max_total_tokens or max(context, sum(pages(len(c) + args.new_tokens) for c in chat_ids))
    engine_kwargs = dict(context_length=context, max_total_tokens=pool, page_size=page,
                         max_running_requests=args.num_prompts,
                         chunked_prefill_size=args.chunked_prefill_size, kernel_backend=args.kernel_backend)
    print(f"model {model}")
    print(f"text: the first {used} of {num_topics} pydoc_data.topics entries (sorted keys) of Python "
          f"{sys.version.split()[0]}, cut at {args.tokens} tokens (sha256 of the ids "
          f"{ids_digest(text_ids)}), scored as one prompt: {args.tokens - 1} tokens, each given every token "
          "before it")
    print(f"chat: {args.num_prompts} prompts ({min(map(len, chat_ids))}-{max(map(len, chat_ids))} tokens "
          f"with the chat template), greedy, at most {args.new_tokens} new tokens, EOS stops; "
          f"engine {engine_kwargs}", flush=True)

    results = []
    for mode in modes:
        r = run_mode(mode, model, args.quant_dtype, text_ids, chat_ids, args.new_tokens, engine_kwargs)
        results.append(r)
        print(f"{mode}: perplexity {perplexity(r.logprobs):.3f} (scored in {r.ppl_s:.1f} s), greedy "
              f"{sum(map(len, r.outputs))} tokens in {r.greedy_s:.1f} s", flush=True)
    rows = summarize(results)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    print()
    print(markdown_table(rows))
    print()
    print("delta vs fp32: perplexity difference (and relative); mean abs delta logprob: per scored token, "
          "against fp32; greedy identical: chat outputs token-identical to fp32's; common-prefix fraction: "
          "tokens shared with fp32's output before the first difference / the longer of the two, averaged "
          "over prompts; load: Engine start minus precompile (model load, quantization, pool sizing); "
          "weights: the runner's parameters as stored")
    print(f"command: python -m bench.quant_accuracy {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"wall time {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
