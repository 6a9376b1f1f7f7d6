"""Lazy checkpoint tensors: a name map builds an expression, and only the slices a device needs are read.

The `params_from_hf` name maps are plain numpy (np.stack, np.concatenate, .T, reshape, indexing,
arithmetic). Given `LazyArray`s from `get`, those operations build an expression instead of arrays
(`__array_function__`, `__array_ufunc__`); `np.asarray(lazy[index])` then reads only the checkpoint regions
behind that index (safetensors files are memory-mapped, models/weights/safetensors.py). The loader asks
for each device's shard of each parameter (`jax.make_array_from_callback`), so no host ever holds a whole
sharded tensor; without a mesh parameters are materialised one at a time.

An operation with no lazy form materialises its operands (correct, just not lazy) and is counted in
`STATS.fallbacks`. Every source read is counted in `STATS` (tests check what was read).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
Sel = tuple[np.ndarray, ...]  # one int index array per dimension: the outer product is what is read


@dataclasses.dataclass
class ReadStats:
    reads: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # (source, bytes, its bytes)
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # operations that materialised
    # The loader's placed shards: (parameter, shard index, shard bytes as read (float32), bytes read for it).
    shards: list[tuple[str, tuple, int, int]] = dataclasses.field(default_factory=list)
    checkpoint_bytes: int = 0  # every tensor of the checkpoint loaded last, as float32

    def clear(self) -> None:
        self.checkpoint_bytes = 0
        self.reads.clear()
        self.fallbacks.clear()
        self.shards.clear()

    def bytes_read(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.reads)

    def bytes_of_sources(self) -> int:
        """Bytes (as float32) of every source tensor read from at least partly."""
        return sum({name: total for name, _, total in self.reads}.values())


STATS = ReadStats()


def _whole(shape: Sequence[int]) -> Sel:
    return tuple(np.arange(n) for n in shape)


def _lens(sel: Sel) -> tuple[int, ...]:
    return tuple(len(s) for s in sel)


class LazyArray(NDArrayOperatorsMixin):
    """A tensor that is computed from checkpoint tensors on demand, region by region."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def _read(self, sel: Sel) -> np.ndarray:
        """The outer-product selection `sel` of this tensor, shape `_lens(sel)`."""
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"

    def __array__(self, dtype=None, copy=None):
        out = self._read(_whole(self.shape))
        return out if dtype is None else out.astype(dtype, copy=False)

    def __float__(self) -> float:
        return float(np.asarray(self))

    def __getitem__(self, key):
        return _select(self, key)

    def __getattr__(self, name: str):
        # Any other ndarray method works on the materialised array (counted: it is not lazy).
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(name)
        STATS.fallbacks.append(f"ndarray.{name}")
        return getattr(np.asarray(self), name)

    @property
    def T(self) -> LazyArray:
        return self.transpose()

    def transpose(self, *axes) -> LazyArray:
        if len(axes) == 1 and not isinstance(axes[0], int):
            axes = tuple(axes[0]) if axes[0] is not None else ()
        axes = tuple(a % self.ndim for a in axes) or tuple(reversed(range(self.ndim)))
        return _Transpose(self, axes)

    def swapaxes(self, a: int, b: int) -> LazyArray:
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return _Transpose(self, tuple(axes))

    def reshape(self, *shape, order="C") -> LazyArray:
        if order != "C":
            raise NotImplementedError("lazy reshape supports C order only")
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return _reshape(self, shape)

    def squeeze(self, axis=None) -> LazyArray:
        axes = range(self.ndim) if axis is None else np.atleast_1d(axis) % self.ndim
        return self.reshape(tuple(n for i, n in enumerate(self.shape) if not (i in axes and n == 1)))

    def ravel(self) -> LazyArray:
        return self.reshape(-1)

    flatten = ravel

    def copy(self) -> LazyArray:
        return self  # immutable

    def astype(self, dtype, copy: bool = True) -> LazyArray:
        dtype = np.dtype(dtype)
        return (
            self
            if dtype == self.dtype
            else _Elementwise(lambda a: a.astype(dtype), (self,), self.shape, dtype)
        )

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or "out" in kwargs or ufunc.nout != 1:
            return _materialised(getattr(ufunc, method), inputs, kwargs)
        fn = functools.partial(ufunc, **kwargs) if kwargs else ufunc
        return _elementwise(fn, inputs)

    def __array_function__(self, func, types, args, kwargs):
        handler = _FUNCTIONS.get(func)
        if handler is None:
            return _materialised(func, args, kwargs)
        return handler(*args, **kwargs)


def _materialised(func, args, kwargs):
    STATS.fallbacks.append(getattr(func, "__name__", repr(func)))

    def real(x):
        if isinstance(x, LazyArray):
            return np.asarray(x)
        if isinstance(x, (list, tuple)):
            return type(x)(real(v) for v in x)
        return x

    return func(*real(args), **{k: real(v) for k, v in kwargs.items()})


def lazy(x, name: str = "") -> LazyArray:
    """`x` as a LazyArray (an ndarray or np.memmap becomes a source read region by region)."""
    return x if isinstance(x, LazyArray) else Source(np.asarray(x), name)


class Source(LazyArray):
    """A stored array (typically a memory map of a checkpoint file); floats are read as float32."""

    def __init__(self, array: np.ndarray, name: str = ""):
        self.array, self.name = array, name
        self.shape = tuple(array.shape)
        floating = np.issubdtype(array.dtype, np.floating) or array.dtype.name in _ML_FLOATS
        self.dtype = np.dtype(np.float32) if floating else array.dtype

    def _read(self, sel: Sel) -> np.ndarray:
        # Contiguous ranges become slices (a memory map then touches only those bytes); others are gathered.
        slices, gathers = [], []
        for axis, s in enumerate(sel):
            if len(s) == 0 or (s[-1] - s[0] == len(s) - 1 and np.all(np.diff(s) == 1)):
                slices.append(slice(int(s[0]), int(s[-1]) + 1) if len(s) else slice(0, 0))
            else:
                slices.append(slice(None))
                gathers.append((axis, s))
        view = self.array[tuple(slices)]
        for axis, s in gathers:
            view = np.take(view, s, axis=axis)
        out = np.asarray(view).astype(self.dtype, copy=True)
        STATS.reads.append((self.name, out.nbytes, self.nbytes))
        return out


class _Transpose(LazyArray):
    def __init__(self, child: LazyArray, axes: tuple[int, ...]):
        self.child, self.axes = child, axes
        self.shape = tuple(child.shape[a] for a in axes)
        self.dtype = child.dtype

    def _read(self, sel: Sel) -> np.ndarray:
        child_sel = [None] * len(self.axes)
        for j, a in enumerate(self.axes):
            child_sel[a] = sel[j]
        return self.child._read(tuple(child_sel)).transpose(self.axes)


class _Select(LazyArray):
    """child[key] for ints, slices, Ellipsis and at most one integer/boolean array (outer indexing)."""

    def __init__(self, child: LazyArray, base: Sel, dropped: tuple[bool, ...]):
        self.child, self.base, self.dropped = child, base, dropped
        self.shape = tuple(len(s) for s, d in zip(base, dropped) if not d)
        self.dtype = child.dtype

    def _read(self, sel: Sel) -> np.ndarray:
        kept = iter(sel)
        child_sel = tuple(b if d else b[next(kept)] for b, d in zip(self.base, self.dropped))
        out = self.child._read(child_sel)
        return out.reshape(_lens(sel)) if any(self.dropped) else out


def _select(x: LazyArray, key):
    key = key if isinstance(key, tuple) else (key,)
    arrays = sum(isinstance(k, (list, np.ndarray)) for k in key)
    if any(k is None for k in key) or arrays > 1:
        return _materialised(lambda a: a[key], (x,), {})
    if any(k is Ellipsis for k in key):
        at = key.index(Ellipsis)
        key = key[:at] + (slice(None),) * (x.ndim - len(key) + 1) + key[at + 1 :]
    if len(key) > x.ndim:
        raise IndexError(f"too many indices for a {x.ndim}-d lazy array")
    key = key + (slice(None),) * (x.ndim - len(key))
    base, dropped = [], []
    for k, n in zip(key, x.shape):
        if isinstance(k, slice):
            base.append(np.arange(*k.indices(n)))
            dropped.append(False)
        elif isinstance(k, (list, np.ndarray)):
            k = np.asarray(k)
            k = np.nonzero(k)[0] if k.dtype == bool else k.astype(np.int64) % n
            if k.ndim != 1:
                return _materialised(lambda a: a[key], (x,), {})
            base.append(k)
            dropped.append(False)
        else:
            i = int(k)
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for a dimension of {n}")
            base.append(np.array([i % n]))
            dropped.append(True)
    return _Select(x, tuple(base), tuple(dropped))


class _Stack(LazyArray):
    def __init__(self, children: Sequence[LazyArray], axis: int):
        self.children, self.axis = list(children), axis
        shape = children[0].shape
        if any(c.shape != shape for c in children):
            raise ValueError(f"stack: shapes differ: {sorted({c.shape for c in children})}")
        self.shape = shape[:axis] + (len(children),) + shape[axis:]
        self.dtype = np.result_type(*[c.dtype for c in children])

    def _read(self, sel: Sel) -> np.ndarray:
        rest = sel[: self.axis] + sel[self.axis + 1 :]
        parts = {
            i: self.children[i]._read(rest).astype(self.dtype, copy=False) for i in np.unique(sel[self.axis])
        }
        if not parts:
            return np.empty(_lens(sel), self.dtype)
        return np.stack([parts[i] for i in sel[self.axis]], axis=self.axis)


class _Concat(LazyArray):
    def __init__(self, children: Sequence[LazyArray], axis: int):
        self.children, self.axis = list(children), axis
        sizes = [c.shape[axis] for c in children]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        shape = children[0].shape
        self.shape = shape[:axis] + (int(self.offsets[-1]),) + shape[axis + 1 :]
        self.dtype = np.result_type(*[c.dtype for c in children])

    def _read(self, sel: Sel) -> np.ndarray:
        s = sel[self.axis]
        owner = np.searchsorted(self.offsets[1:], s, side="right")
        out = np.empty(_lens(sel), self.dtype)
        moved = np.moveaxis(out, self.axis, 0)
        for c in np.unique(owner):
            mask = owner == c
            part_sel = sel[: self.axis] + (s[mask] - self.offsets[c],) + sel[self.axis + 1 :]
            moved[mask] = np.moveaxis(self.children[c]._read(part_sel), self.axis, 0)
        return out


def _reshape_groups(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[range, range]]:
    """Splits both shapes into runs of axes with equal products (each run is one split or merge)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        i0, j0, po, pn = i, j, 1, 1
        if i < len(old):
            po, i = old[i], i + 1
        if j < len(new):
            pn, j = new[j], j + 1
        while po != pn:
            if po < pn:
                po, i = po * old[i], i + 1
            else:
                pn, j = pn * new[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


class _Reshape(LazyArray):
    """Reads, per group of axes, the box of source indices the requested elements need, then gathers."""

    def __init__(self, child: LazyArray, shape: tuple[int, ...]):
        self.child, self.shape, self.dtype = child, shape, child.dtype
        self.groups = _reshape_groups(child.shape, shape)

    def _read(self, sel: Sel) -> np.ndarray:
        old = self.child.shape
        child_sel: list = [None] * len(old)
        plans = []
        for old_axes, new_axes in self.groups:
            new_sel = [sel[j] for j in new_axes]
            flat = (
                np.ravel_multi_index(np.ix_(*new_sel), [self.shape[j] for j in new_axes])
                if new_axes
                else np.zeros((), np.int64)
            )
            old_idx = np.unravel_index(flat, [old[i] for i in old_axes]) if old_axes else ()
            uniq = [np.unique(o) for o in old_idx]
            for i, u in zip(old_axes, uniq):
                child_sel[i] = u
            local = [np.searchsorted(u, o) for u, o in zip(uniq, old_idx)]
            plans.append((old_axes, flat.shape, local, [len(u) for u in uniq]))
        box = self.child._read(tuple(child_sel))
        for old_axes, grid, local, box_dims in reversed(
            plans
        ):  # last group first: earlier axes keep their place
            p0, p1 = old_axes.start, old_axes.stop
            merged = box.reshape(box.shape[:p0] + (int(np.prod(box_dims, dtype=np.int64)),) + box.shape[p1:])
            at = np.ravel_multi_index(local, box_dims) if local else np.zeros(grid, np.int64)
            box = np.take(merged, at, axis=p0)
        return box


def _reshape(x: LazyArray, shape: tuple[int, ...]) -> LazyArray:
    shape = tuple(int(n) for n in shape)
    if -1 in shape:
        known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
        shape = tuple(x.size // known if n == -1 else n for n in shape)
    if int(np.prod(shape, dtype=np.int64)) != x.size:
        raise ValueError(f"cannot reshape {x.shape} into {shape}")
    if shape == x.shape:
        return x
    if 0 in shape:
        return lazy(np.zeros(shape, x.dtype))
    return _Reshape(x, shape)


class _Elementwise(LazyArray):
    def __init__(self, fn: Callable, operands: Sequence, shape: tuple[int, ...], dtype: np.dtype):
        self.fn, self.operands, self.shape, self.dtype = fn, list(operands), shape, dtype

    def _read(self, sel: Sel) -> np.ndarray:
        parts = []
        for op in self.operands:
            if not isinstance(op, (LazyArray, np.ndarray)) or np.ndim(op) == 0:
                parts.append(op)
                continue
            op_sel = tuple(
                s if n != 1 else np.zeros(min(len(s), 1), np.int64)
                for s, n in zip(sel[len(sel) - op.ndim :], op.shape)
            )
            parts.append(op._read(op_sel) if isinstance(op, LazyArray) else op[np.ix_(*op_sel)])
        return np.broadcast_to(np.asarray(self.fn(*parts)), _lens(sel)).astype(self.dtype, copy=False)


def _elementwise(fn: Callable, operands: Sequence) -> LazyArray:
    dummies = [
        np.ones((1,) * np.ndim(op), op.dtype) if isinstance(op, (LazyArray, np.ndarray)) else op
        for op in operands
    ]
    with np.errstate(all="ignore"):
        dtype = np.asarray(fn(*dummies)).dtype
    shape = np.broadcast_shapes(
        *[np.shape(op) if not isinstance(op, LazyArray) else op.shape for op in operands]
    )
    return _Elementwise(fn, operands, tuple(shape), dtype)


def _stack(arrays, axis: int = 0, **kwargs) -> LazyArray:
    if kwargs.get("out") is not None:
        return _materialised(np.stack, (arrays,), {"axis": axis, **kwargs})
    arrays = [lazy(a) for a in arrays]
    return _Stack(arrays, axis % (arrays[0].ndim + 1))


def _concatenate(arrays, axis: int | None = 0, **kwargs) -> LazyArray:
    if axis is None or kwargs.get("out") is not None:
        return _materialised(np.concatenate, (arrays,), {"axis": axis, **kwargs})
    arrays = [lazy(a) for a in arrays]
    return arrays[0] if len(arrays) == 1 else _Concat(arrays, axis % arrays[0].ndim)


def _moveaxis(a, source, destination) -> LazyArray:
    a = lazy(a)
    order = [i for i in range(a.ndim) if i != source % a.ndim]
    order.insert(destination % a.ndim, source % a.ndim)
    return a.transpose(order)


def _split(a, indices_or_sections, axis: int = 0) -> list[LazyArray]:
    a = lazy(a)
    n = a.shape[axis]
    if isinstance(indices_or_sections, int):
        if n % indices_or_sections:
            raise ValueError("array split does not result in an equal division")
        bounds = list(range(0, n + 1, n // indices_or_sections))
    else:
        bounds = [0, *indices_or_sections, n]
    pre = (slice(None),) * (axis % a.ndim)
    return [a[pre + (slice(lo, hi),)] for lo, hi in zip(bounds[:-1], bounds[1:])]


_FUNCTIONS: dict[Callable, Callable] = {
    np.stack: _stack,
    np.concatenate: _concatenate,
    np.transpose: lambda a, axes=None: lazy(a).transpose(axes),
    np.swapaxes: lambda a, x, y: lazy(a).swapaxes(x, y),
    np.moveaxis: _moveaxis,
    np.reshape: lambda a, shape=None, order="C", **kw: lazy(a).reshape(
        kw.get("newshape", shape), order=order
    ),
    np.squeeze: lambda a, axis=None: lazy(a).squeeze(axis),
    np.ravel: lambda a: lazy(a).ravel(),
    np.split: _split,
    np.where: lambda c, x, y: _elementwise(np.where, (c, x, y)),
    np.clip: lambda a, lo, hi: _elementwise(np.clip, (a, lo, hi)),
    np.shape: lambda a: a.shape,
    np.ndim: lambda a: a.ndim,
}


class _AlongAxis(LazyArray):
    """`fn` of blocks that hold `axis` whole (e.g. per-channel quantization, which reduces over it). `keep`:
    the output has `axis` too (then selected after `fn`); otherwise `fn` reduces it away."""

    def __init__(self, fn: Callable, child: LazyArray, axis: int, keep: bool, dtype):
        self.fn, self.child, self.axis, self.keep = fn, child, axis % child.ndim, keep
        self.shape = child.shape if keep else child.shape[: self.axis] + child.shape[self.axis + 1 :]
        self.dtype = np.dtype(dtype)

    def _read(self, sel: Sel) -> np.ndarray:
        whole = np.arange(self.child.shape[self.axis])
        if self.keep:
            block = self.fn(self.child._read(sel[: self.axis] + (whole,) + sel[self.axis + 1 :]))
            return np.take(block, sel[self.axis], axis=self.axis).astype(self.dtype, copy=False)
        return np.asarray(
            self.fn(self.child._read(sel[: self.axis] + (whole,) + sel[self.axis :])), self.dtype
        )


def sources(x) -> list[LazyArray]:
    """The stored tensors a lazy expression reads: its leaves (a `Source`, a GGUF file's tensor, ...)."""
    out, stack = [], [lazy(x)]
    while stack:
        a = stack.pop()
        inputs = []
        for name in ("child", "children", "operands"):  # the expression nodes' inputs, above
            value = a.__dict__.get(name, [])
            inputs += [c for c in (value if isinstance(value, list) else [value]) if isinstance(c, LazyArray)]
        if inputs:
            stack.extend(inputs)
        else:
            out.append(a)
    return out


def along_axis(fn: Callable, x, axis: int, *, keep: bool, dtype) -> LazyArray:
    """Lazy `fn(x)` where `fn` needs `axis` whole and works independently across the other axes."""
    return _AlongAxis(fn, lazy(x), axis, keep, dtype)
