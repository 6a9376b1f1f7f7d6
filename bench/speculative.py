"""Speculative decoding against plain decoding, one engine of each in the same process and run: output
tokens/s of greedy requests on input-grounded prompts (repeat a given paragraph, rewrite given code), on
free-form chat, one request at a time (batch 1), and of a batch of chats sent together; with the drafts'
mean accepted length and acceptance rate, and (one at a time) the tokens/s of the decode phase alone (each
prompt's prefill and first token timed again on their own and taken out). The two engines take turns
prompt by prompt, so drift of the
machine hits both. Greedy outputs must be identical (speculation verifies exactly): mismatches are counted.

`--algorithm standalone --draft-model P` drafts with a model instead of prompt lookup. `--oracle` drafts
the plain engine's own next tokens (every draft is right): the ceiling the verify step's cost allows, on
any model, random-weight ones included (`--random-prompts` when the model has no tokenizer).

    python -m bench.speculative [--model M] [--quantization auto] [--num-draft-tokens N] [--batch 32]
"""

from __future__ import annotations

import argparse
import inspect
import json
import textwrap
import time
from typing import Any

import numpy as np

from bench.engine_flags import add_engine_flags, engine_kwargs
from bench.quant_accuracy import CHAT_PROMPTS, chat_prompt_ids


def grounded_prompts(num: int) -> list[str]:
    """Half: repeat a paragraph of CPython's documentation (`pydoc_data.topics`); half: rewrite a stdlib
    function with type hints (its source in the prompt)."""
    import json as json_module
    import string
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            words = para.split()
            if 60 <= len(words) <= 120 and para.strip()[0].isalpha():
                paras.append(" ".join(words))
    funcs = [string.capwords, textwrap.indent, textwrap.dedent, json_module.dumps, inspect.cleandoc,
             inspect.getmodulename]
    out = []
    for i in range(num):
        if i % 2 == 0:
            para = paras[(i // 2) * 37 % len(paras)]
            out.append(f"Repeat the following text exactly, word for word:\n\n{para}")
        else:
            src = inspect.getsource(funcs[(i // 2) % len(funcs)])
            out.append(f"Rewrite this Python function with type hints added, keeping everything else the "
                       f"same:\n\n```python\n{src}```")
    return out


def _spec_counts(engine) -> tuple[int, int, int, int]:
    s = engine.scheduler.speculator
    if s is None:
        return 0, 0, 0, 0
    return s.verify_steps, s.draft_tokens, s.accepted_tokens, s.declined_steps


def _timed(engine, ids, new_tokens: int) -> tuple[list, float]:
    sampling = {"temperature": 0, "max_new_tokens": new_tokens}
    t = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=sampling)
    seconds = time.perf_counter() - t
    for o in out if isinstance(out, list) else [out]:  # a failed request is not a timing
        if o["meta_info"]["finish_reason"]["type"] == "abort":
            raise SystemExit(f"a request failed: {o['meta_info']['finish_reason']}")
    return out, seconds


def _trace_steps(engine) -> list[tuple[float, int, bool]]:
    """Starts recording each scheduler step of `engine`: (seconds, requests running before it, whether it
    verified drafts). Returns the list it appends to."""
    sched, log = engine.scheduler, []
    inner = sched._step

    def step():
        running, verified = len(sched.running), _spec_counts(engine)[0]
        t = time.perf_counter()
        out = inner()
        log.append((time.perf_counter() - t, running, _spec_counts(engine)[0] > verified))
        return out
    sched._step = step
    return log


def step_summary(log: list[tuple[float, int, bool]]) -> dict[str, Any]:
    """Steps, their seconds in all, and the mean ms of plain and verify steps by requests running (bands of
    32+, 16-31, 8-15, 2-7, 1, and 0: admitting the batch)."""
    out: dict[str, Any] = {"steps": len(log), "step_seconds": sum(s for s, _, _ in log)}
    for lo, hi in ((32, 1 << 30), (16, 31), (8, 15), (2, 7), (1, 1), (0, 0)):
        for verify in (False, True):
            times = [s for s, n, v in log if lo <= n <= hi and v == verify]
            if times:
                out[f"{lo}-{hi if hi < 1 << 30 else ''}{' verify' if verify else ''}"] = (
                    len(times), round(1e3 * float(np.mean(times)), 3))
    return out


def _prefill_seconds(engine, ids) -> float:
    """How long `ids`' prefill and first token take alone, from an empty prefix cache as the timed request
    started."""
    engine.scheduler.flush_cache()
    return _timed(engine, ids, 1)[1]


def run(task: str, engines: dict, prompts: list[list[int]], new_tokens: int, batch: bool,
        oracle: bool = False, repeats: int = 1) -> dict[str, Any]:
    """Each engine on `prompts` (one at a time, engines taking turns; or all at once when `batch`). `oracle`:
    the plain engine runs first, and the speculating one drafts its tokens. One at a time, each prompt's
    prefill is also timed alone, for the tokens/s of the decode phase (what speculation speeds up)."""
    tokens = {k: 0 for k in engines}
    seconds = {k: 0.0 for k in engines}
    prefill = {k: 0.0 for k in engines}
    outputs = {k: [] for k in engines}
    before = {k: _spec_counts(e) for k, e in engines.items()}
    logs = {k: _trace_steps(e) for k, e in engines.items()} if batch else {}
    groups = [prompts] * repeats if batch else [[p] for p in prompts]  # (a batch: engines alternating)
    for i, group in enumerate(groups):
        order = list(engines) if i % 2 == 0 or oracle else list(engines)[::-1]
        for k in order:
            if oracle and k == "spec":
                _draft_from(engines[k], group, outputs["off"][-len(group):])
            engines[k].scheduler.flush_cache()  # every timed request from an empty prefix cache
            out, dt = _timed(engines[k], group, new_tokens)
            seconds[k] += dt
            if not batch:
                prefill[k] += _prefill_seconds(engines[k], group)
            tokens[k] += sum(len(o["output_ids"]) for o in out)
            outputs[k] += [o["output_ids"] for o in out]
    row: dict[str, Any] = {"task": task, "batch": len(prompts) if batch else 1, "requests": len(prompts)}
    for k in engines:
        row[f"{k}_tok_s"] = tokens[k] / seconds[k]
        row[f"{k}_tokens"] = tokens[k]
    row["speedup"] = row["spec_tok_s"] / row["off_tok_s"]
    if not batch:  # the tokens after the first over the time after the first token
        for k in engines:
            row[f"{k}_decode_tok_s"] = (tokens[k] - len(prompts)) / (seconds[k] - prefill[k])
        row["decode_speedup"] = row["spec_decode_tok_s"] / row["off_decode_tok_s"]
    counts = zip(_spec_counts(engines["spec"]), before["spec"])
    steps, drafts, accepted, declined = (a - b for a, b in counts)
    row["verify_steps"], row["draft_tokens"], row["accepted_tokens"] = steps, drafts, accepted
    row["declined_steps"] = declined  # decode steps whose drafts the measured costs said not to verify
    row["mean_accept_length"] = 1 + accepted / steps if steps else None
    row["acceptance_rate"] = accepted / drafts if drafts else None
    row["mismatches"] = sum(a != b for a, b in zip(outputs["off"], outputs["spec"]))
    for k, log in logs.items():  # where a batch's time went: steps, and their times by shape
        row[f"{k}_steps"] = step_summary(log)
        row[f"{k}_seconds"] = seconds[k]
        del engines[k].scheduler._step
    return row


def _draft_from(engine, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Makes `engine` draft the given outputs of `prompts` (every draft right)."""
    futures = {tuple(p): o for p, o in zip(prompts, outputs)}

    def draft(req, k):
        out = futures[tuple(req.prompt_ids)]
        return np.asarray(out[len(req.output_ids): len(req.output_ids) + k], np.int32)
    engine.scheduler.speculator.drafter = draft
    engine.scheduler.speculator.model_drafter = None


def main(argv: list[str] | None = None) -> None:
    from serve import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(p)
    p.add_argument("--algorithm", default="ngram", choices=("ngram", "standalone"))
    p.add_argument("--draft-model", default=None, help="standalone: the draft model")
    p.add_argument("--drafts-off", action="store_true",
                   help="the speculating engine drafts nothing: what its verify machinery costs alone")
    p.add_argument("--fixed-drafts", action="store_true",
                   help="verify every draft that fits (no weighing of measured step times)")
    p.add_argument("--oracle", action="store_true", help="draft the plain engine's own tokens (all right)")
    p.add_argument("--random-prompts", type=int, default=0,
                   help="N random token prompts of 128 tokens instead of text (a model without a tokenizer)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft tokens per request and step, at most (default: the server's "
                   "--speculative-num-draft-tokens: 7 for ngram, 4 for standalone or --fixed-drafts on CPU)")
    p.add_argument("--ngram-min-match", type=int, default=2)
    p.add_argument("--ngram-max-match", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per batch-1 task")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="chats sent together in the batch task (0: skip)")
    p.add_argument("--batch-repeats", type=int, default=3,
                   help="times each engine runs the batch task, taking turns (a run takes under a second on "
                   "a GPU)")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="each engine's decode rows (default: the batch, at least 8; more leaves the batch "
                   "task room for drafts, as a server's default does)")
    p.add_argument("--output-file", default=None, help="append one JSON line per task")
    args = p.parse_args(argv)
    rows = args.max_running_requests or max(args.batch, 8)
    common = dict(in_process=True, **engine_kwargs(args), max_running_requests=rows, context_length=2048,
                  # two engines in one process: each its own pools, sized for its requests (on a GPU the
                  # first would otherwise take the memory fraction and leave the second none)
                  max_total_tokens=max(args.batch, 8) * 2048,
                  skip_tokenizer_init=args.random_prompts > 0)
    draft = ({"speculative_draft_model_path": args.draft_model} if args.algorithm == "standalone" else
             {"speculative_ngram_min_match_window_size": args.ngram_min_match,
              "speculative_ngram_max_match_window_size": args.ngram_max_match})
    engines = {"off": Engine(**common),
               "spec": Engine(speculative_algorithm=args.algorithm,
                              speculative_num_draft_tokens=args.num_draft_tokens,
                              speculative_fixed_drafts=args.fixed_drafts, **draft, **common)}
    name = "oracle" if args.oracle else args.algorithm
    if args.drafts_off:
        engines["spec"].scheduler.speculator.drafter = lambda req, k: np.zeros(0, np.int32)
        name = "no drafts"
    try:
        if args.random_prompts:
            rng = np.random.default_rng(0)
            vocab = engines["off"].scheduler.runner.model_cfg.vocab_size
            tasks = [("random", [rng.integers(3, vocab, 128).tolist() for _ in range(args.random_prompts)])]
            chats = tasks[0][1]
        else:
            tok = engines["off"].tokenizer
            chats = chat_prompt_ids(tok, CHAT_PROMPTS)
            tasks = [("grounded", chat_prompt_ids(tok, grounded_prompts(args.num_prompts))),
                     ("chat", chats[: args.num_prompts])]
        for e in engines.values():  # warm-up
            _timed(e, [tasks[0][1][0]], 8)
        rows = [run(task, engines, prompts, args.new_tokens, batch=False, oracle=args.oracle)
                for task, prompts in tasks]
        if args.batch:
            batch = [chats[i % len(chats)] for i in range(args.batch)]
            rows.append(run(tasks[-1][0], engines, batch, args.new_tokens, batch=True, oracle=args.oracle,
                            repeats=args.batch_repeats))
        info = engines["spec"].scheduler.speculative_info()
        if info.get("adaptive"):  # what the drafts were weighed against
            print(f"speculating engine's decode step times (ms, by rows x page width): {info['step_ms']}")
    finally:
        for e in engines.values():
            e.shutdown()
    print(f"| task | batch | off tok/s | {name} tok/s | speedup | decode phase: off / {name} tok/s, "
          "speedup | mean accepted length | acceptance | verify / declined steps | greedy mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mal = "-" if r["mean_accept_length"] is None else f"{r['mean_accept_length']:.2f}"
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        decode = ("-" if "decode_speedup" not in r else
                  f"{r['off_decode_tok_s']:.1f} / {r['spec_decode_tok_s']:.1f}, {r['decode_speedup']:.2f}x")
        print(f"| {r['task']} | {r['batch']} | {r['off_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {decode} | {mal} | {acc} | "
              f"{r['verify_steps']} / {r['declined_steps']} | {r['mismatches']} |")
    for r in rows:
        for k in ("off", "spec"):
            if f"{k}_steps" in r:
                print(f"{r['task']} x{r['batch']}, {k}: {r[k + '_seconds']:.3f} s, {r[k + '_steps']}")
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
