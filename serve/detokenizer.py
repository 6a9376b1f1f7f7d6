"""The detokenizer process: token ids -> text deltas, holding back incomplete UTF-8 and possible stop
strings."""

from __future__ import annotations

import dataclasses
import sys
import traceback

import zmq

from scheduler.stop import trim_stop_string
from serve.io_struct import AbortReq, BatchTokenOut, TokenOut
from serve.server_args import ServerArgs


@dataclasses.dataclass
class _Stream:
    ids: list[int] = dataclasses.field(default_factory=list)
    sent: str = ""  # text already delivered
    # Incremental decoding (`Detokenizer._text`): the text of ids[:read] is `text`; ids[prefix:read] is the
    # window of context the next tokens are decoded after (both decodes start at `prefix`, so whatever a
    # decoder does at the start of a text cancels out).
    text: str = ""
    prefix: int = 0
    read: int = 0


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that might start a stop string (not safe to send yet)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class Detokenizer:
    """Incremental detokenization per request: each output's new tokens are decoded after a window of the
    few before them, as vLLM and SGLang do (a text ending in U+FFFD, a character whose bytes are still
    incomplete, waits for more tokens), and a finished request's whole output is decoded once, so its text
    is exactly a full decode. Re-decoding every output whole at every step cost O(length) a token: 2 ms a
    step per request of 8 k tokens on a 2-core CPU, 47-82 ms a step for 32 of them (`python -m
    bench.detokenizer`, docs/benchmarks.md).

    A request whose output fails to detokenize ends alone: `process` turns that output into an error (status
    500) and drops the request's later outputs; `take_failed` names the ones the scheduler should abort.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self.streams: dict[str, _Stream] = {}
        self.failed: set[str] = set()  # ended by an error while the scheduler may still run them
        self._to_abort: list[str] = []

    def process(self, out: TokenOut) -> TokenOut | None:
        """`out` with `text_delta` set (or turned into an error); None for an output of a failed request."""
        if out.rid in self.failed:
            if out.finish_reason is not None:
                self.failed.discard(out.rid)
            return None
        try:
            return self._process(out)
        except Exception as e:  # noqa: BLE001 - a decode error ends this request, never the others
            traceback.print_exc(file=sys.stderr)
            message = f"detokenization failed: {type(e).__name__}: {e}"
            self.streams.pop(out.rid, None)
            if out.finish_reason is None:
                self.failed.add(out.rid)
                self._to_abort.append(out.rid)
            out.error, out.error_status, out.text_delta = message, 500, ""
            out.finish_reason = {"type": "abort", "message": message}
            return out

    def take_failed(self) -> list[str]:
        """Requests failed since the last call that are still running in the scheduler (abort them there)."""
        rids, self._to_abort = self._to_abort, []
        return rids

    def _process(self, out: TokenOut) -> TokenOut:
        st = self.streams.setdefault(out.rid, _Stream())
        st.ids.extend(out.new_ids)
        finished = out.finish_reason is not None
        ids = st.ids
        if (finished and not out.skip_special_tokens and ids and out.finish_reason.get("matched") == ids[-1]
                and ids[-1] in self._special_ids):
            # The special token that ended the request (EOS, <|im_end|>) is not text of it even with
            # skip_special_tokens off (kept on for tool-call markup written in special tokens), as in vLLM.
            ids = ids[:-1]
        if finished:  # decoded whole once: exactly the full decode
            from scheduler.request import FinishReason

            text = self.tokenizer.decode(ids, skip_special_tokens=out.skip_special_tokens) if ids else ""
            reason = FinishReason(**{k: v for k, v in out.finish_reason.items() if k in ("type", "matched")})
            text = trim_stop_string(text, reason)
            del self.streams[out.rid]
        else:
            text = self._text(st, out.skip_special_tokens)
            # A trailing U+FFFD may be an incomplete UTF-8 sequence (at most 3 bytes, so at most 3 such
            # characters) waiting for its next bytes; hold back no more than that, since the model can also
            # emit U+FFFD itself as a complete character.
            run = len(text) - len(text.rstrip("\ufffd"))
            text = text[: len(text) - min(run, 3)]
            if out.stop:
                text = text[: len(text) - _held_back(text, out.stop)]
        if text.startswith(st.sent):
            out.text_delta = text[len(st.sent):]
            st.sent = text
        else:  # a re-decode changed already-sent text (rare); send nothing that contradicts it
            out.text_delta = ""
        return out

    def _text(self, st: _Stream, skip: bool) -> str:
        """The text of `st.ids` so far, decoding only the tokens after `st.read` (after the window from
        `st.prefix`) and moving the window on once their text is whole (`skip`: the request's
        skip_special_tokens, the same for all its outputs)."""
        decode = self.tokenizer.decode
        before = decode(st.ids[st.prefix:st.read], skip_special_tokens=skip) if st.read > st.prefix else ""
        while not before and st.prefix > 0:
            # A window with no text of its own (skipped specials) would leave the new tokens at the start of
            # a text, where a decoder may drop a leading space: widen it back to some text (or the start).
            st.prefix = max(0, st.prefix - 8)
            before = decode(st.ids[st.prefix:st.read], skip_special_tokens=skip)
        after = decode(st.ids[st.prefix:], skip_special_tokens=skip)
        if not after.startswith(before):  # a decoder that rewrote the window's text: decode it all
            text = decode(st.ids, skip_special_tokens=skip)
            if not text.endswith("\ufffd"):
                st.text, st.prefix, st.read = text, st.read, len(st.ids)
            return text
        text = st.text + after[len(before):]
        if not after.endswith("\ufffd"):  # whole: these tokens become the next window
            st.text, st.prefix, st.read = text, st.read, len(st.ids)
        return text


def run_detokenizer_process(args: ServerArgs, recv_addr: str, send_addr: str, scheduler_addr: str,
                            report_ready) -> None:
    """Child entry (serve/children.py): token outputs from `recv_addr` go on to `send_addr` with their text;
    aborts for requests that failed to detokenize go to the scheduler at `scheduler_addr`. Runs until the
    stop signal's SystemExit."""
    from serve.setup import load_model_tokenizer_path

    try:
        _, tokenizer = load_model_tokenizer_path(args)
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)  # exiting never waits to deliver to a peer that may be gone
        recv = ctx.socket(zmq.PULL)
        recv.bind(recv_addr)
        send = ctx.socket(zmq.PUSH)
        send.connect(send_addr)
        to_scheduler = ctx.socket(zmq.PUSH)
        to_scheduler.connect(scheduler_addr)
        report_ready({"ok": True})
    except BaseException as e:
        report_ready({"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise
    detok = Detokenizer(tokenizer) if tokenizer is not None else None
    while True:
        msg = recv.recv_pyobj()
        if isinstance(msg, BatchTokenOut) and detok is not None:
            msg.outs = [o for o in map(detok.process, msg.outs) if o is not None]
            for rid in detok.take_failed():
                to_scheduler.send_pyobj(AbortReq(rid))
        send.send_pyobj(msg)
