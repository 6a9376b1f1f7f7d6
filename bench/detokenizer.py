"""Host cost of streaming detokenization per decode step: `serve.detokenizer.Detokenizer` over many running
requests, against the baseline measured in the same run of decoding each request's whole output again at
every step (what the detokenizer did before it decoded incrementally).

    python -m bench.detokenizer --streams 32 --lengths 512,2048,8192

The outputs are real text (the English documentation CPython ships, `pydoc_data.topics`) in the default
model's tokenizer (or `--model`'s), fed one token a step to every stream; each figure is the time of one
step for all streams at that output length (the median of the `--steps` steps ending there).
"""

from __future__ import annotations

import argparse
import statistics
import time

from serve.detokenizer import Detokenizer
from serve.io_struct import TokenOut
from serve.server_args import ServerArgs
from serve.setup import load_model_tokenizer_path


def _text_ids(tokenizer, count: int) -> list[int]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    ids: list[int] = []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key])
        if len(ids) >= count:
            return ids[:count]
    raise ValueError(f"the text has only {len(ids)} tokens, fewer than {count}")


def _step_ms(step, lengths: list[int], steps: int, stateful: bool) -> dict[int, float]:
    """Median ms of `step(i)` (the step that brings the outputs to i + 1 tokens) over the `steps` steps
    ending at each length; a `stateful` step also runs the steps between, untimed."""
    out, i = {}, 0
    for length in lengths:
        times = []
        i = i if stateful else max(i, length - steps)
        while i < length:
            t = time.perf_counter()
            step(i)
            if i >= length - steps:
                times.append(time.perf_counter() - t)
            i += 1
        out[length] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model whose tokenizer to use (default: the server's)")
    ap.add_argument("--streams", type=int, default=32, help="running requests")
    ap.add_argument("--lengths", default="512,2048,8192", help="output lengths to time a step at")
    ap.add_argument("--steps", type=int, default=16, help="steps timed at each length")
    args = ap.parse_args()
    lengths = sorted(int(n) for n in args.lengths.split(","))
    _, tokenizer = load_model_tokenizer_path(ServerArgs(model=args.model))
    ids = _text_ids(tokenizer, lengths[-1])

    detok = Detokenizer(tokenizer)

    def windowed(i: int) -> None:
        for r in range(args.streams):
            detok.process(TokenOut(f"r{r}", [ids[i]], None, 1, i + 1))

    def whole(i: int) -> None:  # the baseline: every stream's whole output decoded again
        for _ in range(args.streams):
            tokenizer.decode(ids[: i + 1], skip_special_tokens=True)

    rows = {"windowed (Detokenizer)": _step_ms(windowed, lengths, args.steps, stateful=True),
            "whole output re-decoded": _step_ms(whole, lengths, args.steps, stateful=False)}
    print(f"ms per step for {args.streams} streams, by output length")
    print(f"{'':26s}" + "".join(f"{n:>10d}" for n in lengths))
    for label, ms in rows.items():
        print(f"{label:26s}" + "".join(f"{ms[n]:10.2f}" for n in lengths))


if __name__ == "__main__":
    main()
