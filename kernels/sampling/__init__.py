"""Row reductions over a step's logits for sampling: the greedy token and the log-normaliser."""

from kernels import backend
from kernels.sampling import reference

argmax_first = backend.dispatched("argmax", reference.argmax_first)
logsumexp = backend.dispatched("logsumexp", reference.logsumexp)

__all__ = ["argmax_first", "logsumexp"]
