"""Multi-host serving: `jax.distributed` from the flags, and the leader's steps replayed on the followers.

Every process of a multi-controller JAX program must run the same compiled programs, in the same order, on
the same inputs. Node 0 (the leader) runs the scheduler; before each step its runner hands the step to a
`StepBroadcaster`, which sends it to every follower over ZMQ (a ROUTER on the coordinator's host, port + 1).
A follower has no scheduler and no HTTP server: `follow` receives each step and runs it on its own runner,
so its devices join the collectives; outputs are replicated, and only the leader reads them. Steps travel
as pickles: a follower trusts the node 0 it was pointed at, as `jax.distributed` does; node 0 reads only
JSON from the followers.
"""

from __future__ import annotations

import atexit
import json
import pickle
import socket
import sys
import time

import jax
import zmq

READY, GO, STEP, STOP = b"ready", b"go", b"step", b"stop"


def split_addr(addr: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); ValueError naming the bad address."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"dist_init_addr={addr!r} must be HOST:PORT (node 0's address; PORT and PORT + 1 "
                         "free there)")
    return host, int(port)


def step_channel(addr: str) -> str:
    """The ZMQ address of the leader's step channel: the coordinator's host, its port + 1."""
    host, port = split_addr(addr)
    return f"tcp://{host}:{port + 1}"


def initialize(nnodes: int, node_rank: int, addr: str) -> None:
    """Joins the `nnodes`-process JAX program (blocks until every process has joined); must run before any
    other JAX use in this process. Afterwards `jax.devices()` lists every host's devices."""
    # XLA's CPU client needs a cross-process collectives implementation (gloo runs over TCP); the option
    # only concerns the CPU client, so it is harmless where the devices are GPUs or TPUs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=addr, num_processes=nnodes, process_id=node_rank,
                               initialization_timeout=300, shutdown_timeout_seconds=10)


class StepBroadcaster:
    """The leader's half: `wait_for_followers` once, then called by the runner before every step."""

    def __init__(self, addr: str, num_followers: int):
        self.num_followers = num_followers
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        host, port = split_addr(addr)
        try:  # only the interface the followers were told about
            self.sock.bind(f"tcp://{socket.gethostbyname(host)}:{port + 1}")
        except (OSError, zmq.ZMQError):  # HOST names this machine by an address it cannot bind (NAT)
            self.sock.bind(f"tcp://*:{port + 1}")
        self.followers: list[bytes] = []
        self.closed = False
        atexit.register(self.close)

    def wait_for_followers(self, runner_config: str, timeout: float) -> None:
        """Blocks until every follower reported ready with the same runner configuration as ours (same
        buckets and pool sizes, hence the same programs); raises RuntimeError on timeout or a mismatch."""
        deadline = time.monotonic() + timeout
        while len(self.followers) < self.num_followers:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise RuntimeError(f"{len(self.followers)} of {self.num_followers} follower nodes ready "
                                   f"after {timeout:.0f} s (start them with the same flags and --node-rank "
                                   "1, 2, ..)")
            frames = self.sock.recv_multipart()
            if len(frames) != 3 or frames[1] != READY:
                continue
            ident, ready = frames[0], json.loads(frames[2])  # JSON: never unpickle what a stranger sent
            rank, theirs = ready["node_rank"], ready["runner_config"]
            if theirs != runner_config:
                self.followers.append(ident)  # so that close() stops it too
                raise RuntimeError(f"node {rank} planned different step programs than node 0 (give every "
                                   f"node the same flags, and --max-total-tokens when memory differs):\n"
                                   f"  node 0: {runner_config}\n  node {rank}: {theirs}")
            self.followers.append(ident)
        for ident in self.followers:
            self.sock.send_multipart([ident, GO, b""])

    def __call__(self, kind: str, shape, batch, out_cache_locs=None, state_saves=None) -> None:
        payload = pickle.dumps((kind, shape, batch, out_cache_locs, state_saves),
                               protocol=pickle.HIGHEST_PROTOCOL)
        for ident in self.followers:
            self.sock.send_multipart([ident, STEP, payload])

    def close(self) -> None:
        """Tells every follower to exit; idempotent."""
        if self.closed:
            return
        self.closed = True
        for ident in self.followers:
            self.sock.send_multipart([ident, STOP, b""])
        self.sock.close()
        self.ctx.term()


def follow(runner, addr: str, node_rank: int, connect_timeout: float = 300.0) -> None:
    """A follower's loop: reports ready, then runs every step the leader sends until it says stop.

    `runner` must be built from the same flags as the leader's (checked by the leader). Returns on stop;
    raises RuntimeError if the leader does not accept us within `connect_timeout`. Should the leader die
    without a stop, `jax.distributed`'s health check ends this process."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(step_channel(addr))
    ready = {"node_rank": node_rank, "runner_config": repr(runner.cfg)}
    sock.send_multipart([READY, json.dumps(ready).encode()])
    steps = 0
    try:
        if not sock.poll(int(connect_timeout * 1000)):
            raise RuntimeError(f"node {node_rank}: node 0 did not answer at {step_channel(addr)} within "
                               f"{connect_timeout:.0f} s")
        if sock.recv_multipart()[0] != GO:
            raise RuntimeError(f"node {node_rank}: node 0 refused us (its log says why)")
        while True:
            kind, payload = sock.recv_multipart()
            if kind == STOP:
                break
            step_kind, shape, batch, locs, saves = pickle.loads(payload)
            if step_kind == "step":
                runner.step(batch, shape)
            else:
                runner.multi_step(batch, shape, locs, saves)
            steps += 1
    finally:
        sock.close()
        ctx.term()
    print(f"[xlaserve] node {node_rank}: node 0 stopped after {steps} steps", file=sys.stderr, flush=True)
