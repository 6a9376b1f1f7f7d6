"""The scheduler process: owns the runtime and the Scheduler; receives requests, steps, sends tokens."""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import zmq

from runtime.sampling_params import SamplingParams
from scheduler import Req
from scheduler.scheduler import QueueFullError
from serve.io_struct import AbortReq, BatchTokenOut, ControlReq, ControlResp, TokenizedGenerateReq, TokenOut
from serve.server_args import ServerArgs


class SchedulerLoop:
    """Drives `Scheduler.step` continuously; new requests and aborts join between steps."""

    def __init__(self, core, recv: zmq.Socket, send: zmq.Socket):
        self.core = core
        self.sched = core.scheduler
        self.recv = recv
        self.send = send
        self.reqs: dict[str, Req] = {}  # everything not yet finished
        self.first_out_sent: set[str] = set()
        self.grammars = None  # GrammarBackend, built on the first structured-output request
        self.started = time.time()

    def run_forever(self) -> None:
        """Never returns; the server stops this process with a signal (serve/children.py)."""
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        while True:
            timeout = 0 if self.sched.has_work() else None  # block while idle, never while busy
            if poller.poll(timeout):
                self._drain()
            if self.sched.has_work():
                self._step()

    def _drain(self) -> None:
        outs: list[TokenOut] = []
        while True:
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(msg, TokenizedGenerateReq):
                out = self._add(msg)
                if out is not None:
                    outs.append(out)
            elif isinstance(msg, AbortReq):
                req = self.sched.abort(msg.rid, "aborted by the client")
                if req is not None:
                    outs.append(self._token_out(req, [], [], []))
                    self.reqs.pop(req.rid, None)
            elif isinstance(msg, ControlReq):
                self.send.send_pyobj(ControlResp(msg.req_id, self._control(msg.kind)))
        if outs:
            self.send.send_pyobj(BatchTokenOut(outs))

    def _add(self, msg: TokenizedGenerateReq) -> TokenOut | None:
        """Queues the request, or returns the refusal to send instead. Never raises: one bad request must not
        stop the loop that serves all the others."""
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            req = Req(rid=msg.rid, prompt_ids=msg.input_ids, params=params, seed=int(params.seed or 0),
                      return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                      top_logprobs_num=msg.top_logprobs_num, grammar=self._grammar(msg.response_format))
            self.sched.add_request(req)
        except QueueFullError as e:
            return self._refusal(msg.rid, f"server overloaded: {e}; retry later", 503)
        except (ValueError, TypeError) as e:  # what validation raises for a bad parameter
            return self._refusal(msg.rid, str(e), 400)
        except Exception as e:  # noqa: BLE001 - a bug, not the client's fault: keep the traceback
            traceback.print_exc(file=sys.stderr)
            return self._refusal(msg.rid, f"internal error adding the request: {type(e).__name__}: {e}", 500)
        self.reqs[req.rid] = req
        return None

    def _grammar(self, response_format: dict | None):
        """A matcher for JSON response formats (ValueError for a bad schema); None for plain text."""
        if not response_format or response_format.get("type", "text") == "text":
            return None
        if self.grammars is None:
            from scheduler.grammar import GrammarBackend

            if self.core.tokenizer is None:
                raise ValueError("response_format needs a tokenizer "
                                 "(server started with skip_tokenizer_init)")
            self.grammars = GrammarBackend(self.core.tokenizer.backend, self.core.runner.model_cfg.vocab_size,
                                           sorted(self.sched.eos_ids))
        return self.grammars.compile(response_format)

    def _refusal(self, rid: str, message: str, status: int) -> TokenOut:
        return TokenOut(rid, [], {"type": "abort", "message": message}, 0, 0, error=message,
                        error_status=status)

    def _step(self) -> None:
        results = self.sched.step()
        outs = []
        for r in results:
            req = self.reqs.get(r.rid)
            if req is None:
                continue
            outs.append(self._token_out(req, r.new_ids, r.new_token_logprobs, r.new_top_logprobs))
            if req.finished:
                del self.reqs[r.rid]
        if outs:
            self.send.send_pyobj(BatchTokenOut(outs))

    def _token_out(self, req: Req, ids, lps, tops) -> TokenOut:
        out = TokenOut(
            rid=req.rid, new_ids=list(ids),
            finish_reason=req.finish_reason.to_dict() if req.finish_reason else None,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, spec_verify_ct=req.spec_verify_steps,
            spec_draft_tokens=req.spec_draft_tokens, spec_accepted_tokens=req.spec_accepted_tokens,
            new_token_logprobs=list(lps), new_top_logprobs=list(tops), stop=tuple(req.params.stop),
            skip_special_tokens=req.params.skip_special_tokens,
        )
        if req.rid not in self.first_out_sent:
            self.first_out_sent.add(req.rid)
            if req.wants_input_logprobs:
                out.input_token_logprobs = [req.input_token_logprobs[i]
                                            for i in sorted(req.input_token_logprobs)]
                if req.top_logprobs_num:
                    out.input_top_logprobs = [req.input_top_logprobs[i]
                                              for i in sorted(req.input_top_logprobs)]
        if req.finished:
            self.first_out_sent.discard(req.rid)
        return out

    def _control(self, kind: str) -> dict[str, Any]:
        """The answer to a control question; an error there is answered as {"error": ...}, never raised."""
        try:
            return self._answer_control(kind)
        except Exception as e:  # noqa: BLE001 - an info query must not stop the loop that serves requests
            traceback.print_exc(file=sys.stderr)
            return {"error": f"{type(e).__name__}: {e}"}

    def _answer_control(self, kind: str) -> dict[str, Any]:
        if kind == "flush_cache":
            try:
                pages = self.core.scheduler.flush_cache()
            except RuntimeError as e:
                return {"success": False, "message": f"prefix cache not flushed: {e}"}
            return {"success": True, "message": f"prefix cache flushed ({pages} pages freed)"}
        return {**self.core.server_info(), "uptime_seconds": time.time() - self.started}


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str, report_ready) -> None:
    """Child entry (serve/children.py): build the core, `report_ready` (or the startup error), loop until the
    stop signal's SystemExit."""
    try:
        from serve.setup import build_core

        core = build_core(args)
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)  # exiting never waits to deliver to a peer that may be gone
        recv = ctx.socket(zmq.PULL)
        recv.bind(recv_addr)
        send = ctx.socket(zmq.PUSH)
        send.connect(send_addr)
        loop = SchedulerLoop(core, recv, send)
        report_ready({"ok": True, "context_length": core.context_length, "model_path": core.model_path,
                      "max_total_tokens": core.scheduler.capacity_tokens,
                      "vocab_size": core.runner.model_cfg.vocab_size,
                      "eos_token_ids": sorted(core.scheduler.eos_ids)})
    except BaseException as e:  # report why startup failed instead of dying silently
        report_ready({"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise
    broadcaster = core.runner.on_step  # multi-host: the followers' step channel, told to stop on our way out
    try:
        loop.run_forever()
    except BaseException as e:
        if not isinstance(e, SystemExit):  # SystemExit is the stop signal
            traceback.print_exc(file=sys.stderr)
            print("[xlaserve] scheduler process crashed", file=sys.stderr, flush=True)
        raise
    finally:
        if broadcaster is not None:
            broadcaster.close()
