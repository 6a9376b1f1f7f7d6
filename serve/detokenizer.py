"""The detokenizer process: token ids -> text deltas, holding back incomplete UTF-8 and possible stop strings."""

from __future__ import annotations

import dataclasses
import os

import zmq

from scheduler.stop import trim_stop_string
from serve.io_struct import BatchTokenOut, TokenOut
from serve.server_args import ServerArgs


@dataclasses.dataclass
class _Stream:
    ids: list[int] = dataclasses.field(default_factory=list)
    sent: str = ""  # text already delivered


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
    """Incremental detokenization per request; the whole output is re-decoded (outputs are short and the
    Rust decoder is fast), so merges across token boundaries come out exactly as a full decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}

    def process(self, out: TokenOut) -> TokenOut:
        st = self.streams.setdefault(out.rid, _Stream())
        st.ids.extend(out.new_ids)
        finished = out.finish_reason is not None
        text = self.tokenizer.decode(st.ids, skip_special_tokens=out.skip_special_tokens) if st.ids else ""
        if finished:
            from scheduler.request import FinishReason

            reason = FinishReason(**{k: v for k, v in out.finish_reason.items() if k in ("type", "matched")})
            text = trim_stop_string(text, reason)
            del self.streams[out.rid]
        else:
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


def run_detokenizer_process(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn) -> None:
    from serve.setup import load_model_tokenizer_path

    try:
        _, tokenizer = load_model_tokenizer_path(args)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(recv_addr)
        send = ctx.socket(zmq.PUSH)
        send.connect(send_addr)
        ready_conn.send({"ok": True})
    except BaseException as e:
        ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise
    detok = Detokenizer(tokenizer) if tokenizer is not None else None
    parent = os.getppid()
    try:
        while True:
            if not recv.poll(1000):
                if os.getppid() != parent:  # the server died without stopping us: exit, never linger
                    return
                continue
            msg = recv.recv_pyobj()
            if isinstance(msg, BatchTokenOut) and detok is not None:
                msg.outs = [detok.process(o) for o in msg.outs]
            send.send_pyobj(msg)
    except KeyboardInterrupt:
        pass
