"""One device mesh for data, tensor and expert parallelism; shardings of weights and pools from logical axes.

Mesh axes `("data", "expert", "tensor")` of sizes (dp, ep, tp // ep): tensor-parallel work (attention
heads, MLP width, vocabulary) spreads over `expert` x `tensor` together (all tp devices), and experts spread
over `expert`, each expert's own width over the remaining `tensor` factor. Every weight's logical axes are
declared once, in `PARAM_AXES`, by the parameter's name; XLA (GSPMD) inserts the collectives.

Data parallelism: weights are replicated over `data`; every pool's slot axis (KV slots, penalty and
recurrent-state rows, `POOL_DATA_AXIS`) is split over it, so rank r owns a contiguous block of pages and
request rows and addresses them with local ids (runtime/step.py:`per_rank` runs the step rank by rank).

Across hosts (runtime/distributed.py) the mesh spans every process's devices and each process places only
its own shards (`place`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from memory import CacheSpec, MemoryPools

# Parameter name suffix -> logical axes of its trailing dimensions (leading stacked-layer axes are None).
# Names not listed are replicated: correct everywhere, just not split.
PARAM_AXES: list[tuple[tuple[str, ...], tuple[str | None, ...]]] = [
    (("experts", "gate_up"), ("expert", None, "expert_mlp")),
    (("experts", "down"), ("expert", "expert_mlp", None)),
    (("experts", "gate_up_scale"), ("expert", "expert_mlp")),
    (("experts", "down_scale"), ("expert", None)),
    (("qkv", "kernel"), (None, "heads")),
    (("qkv", "bias"), ("heads",)),
    (("o", "kernel"), ("heads", None)),
    (("gate", "kernel"), (None, "heads")),  # gated attention's output gate (Qwen3-Next, Ling)
    (("g", "kernel"), (None, "heads")),  # MLA's per-head gate (Ling 3); KDA's output gate
    # Linear attention, its projections grouped by head (models/fused.py): Gated DeltaNet, KDA.
    (("qkvz", "kernel"), (None, "heads")),
    (("ba", "kernel"), (None, "heads")),
    (("b", "kernel"), (None, "heads")),
    (("f", "kernel"), (None, "heads")),
    (("f_b", "kernel"), (None, "heads")),
    (("g_b", "kernel"), (None, "heads")),
    (("gate_up", "kernel"), (None, "mlp")),
    (("gate_up", "bias"), ("mlp",)),
    (("down", "kernel"), ("mlp", None)),
    (("q_b", "kernel"), (None, "heads")),  # MLA
    (("q", "kernel"), (None, "heads")),
    (("w_uk",), (None, "heads", None)),
    (("w_uv",), (None, "heads", None)),
    (("embed",), ("vocab", None)),
    (("lm_head",), (None, "vocab")),
]
# Grouped 4-/8-bit Linear weights (models/quantization.py) are stored transposed, W[out, in], with their
# scales and minimums [out, in / 32]: the kernel's axes swapped. The quantized embedding keeps its axes (a
# quantized untied LM head, [vocab, hidden] under the `lm_head` name, is split as the f32 one would be:
# correct, as every layout is, but gathered for its dot).
PARAM_AXES += [((*suffix[:-1], part), (logical[1], logical[0])) for suffix, logical in list(PARAM_AXES)
               if suffix[-1] == "kernel" for part in ("qkernel", "qscale", "qzero")]
PARAM_AXES += [(("embed_scale",), ("vocab", None)), (("embed_zero",), ("vocab", None))]
# Pools: logical axes of each leaf's trailing dimensions.
POOL_AXES = {
    "kv": (None, None, "heads", None),  # k/v [layers, slots, kv_heads, head_dim]
    # Recurrent states of layers that split over heads (RecurrentSpec.split_heads), and their snapshots:
    # ssm [..., heads, Dk, Dv], conv [..., channels grouped by head, kernel - 1].
    "ssm": ("heads", None, None),
    "conv": ("heads", None),
}
# Pools: the axis of each leaf split over "data" (one block of pages / request rows per rank):
# kv [layers, slots, ...], penalty [rows, vocab], recurrent [layers, rows, ...],
# snapshots [layers, slots, ...].
POOL_DATA_AXIS = {"kv": 1, "penalty": 0, "recurrent": 1, "snapshots": 1}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        if min(self.tp, self.dp, self.ep) < 1:
            raise ValueError(f"parallel sizes must be >= 1: {self}")
        if self.tp % self.ep:
            raise ValueError(f"ep_size={self.ep} must divide tp_size={self.tp} "
                             "(experts spread over the TP devices)")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
        """The mesh over the first dp * tp devices, or None for one device."""
        if self.num_devices == 1:
            return None
        devices = list(devices if devices is not None else jax.devices())
        if len(devices) < self.num_devices:
            raise ValueError(f"tp_size * dp_size = {self.num_devices} needs that many devices; "
                             f"{len(devices)} present")
        grid = np.array(devices[: self.num_devices]).reshape(self.dp, self.ep, self.tp // self.ep)
        return Mesh(grid, ("data", "expert", "tensor"))


def _mesh_axes(mesh: Mesh) -> dict[str, tuple[str, ...]]:
    """Logical axis -> mesh axes it may split over (all tensor-parallel devices for the dense work)."""
    return {
        "heads": ("expert", "tensor"),
        "mlp": ("expert", "tensor"),
        "vocab": ("expert", "tensor"),
        "expert": ("expert",),
        "expert_mlp": ("tensor",),
    }


def _spec(mesh: Mesh, shape: tuple[int, ...], logical: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec for `shape` whose trailing dims have `logical` axes; a dim its mesh axes do not divide
    (e.g. fewer KV heads than TP devices) stays whole (replicated)."""
    rules = _mesh_axes(mesh)
    lead = len(shape) - len(logical)
    parts: list = [None] * lead
    for size, name in zip(shape[lead:], logical):
        axes = tuple(a for a in rules.get(name, ()) if mesh.shape[a] > 1) if name else ()
        count = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        parts.append((axes if len(axes) > 1 else axes[0]) if axes and size % count == 0 else None)
    return PartitionSpec(*parts)


def param_spec(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
    for suffix, logical in PARAM_AXES:
        if tuple(path[-len(suffix) :]) == suffix and len(shape) >= len(logical):
            return _spec(mesh, shape, logical)
    return PartitionSpec()


def param_sharding(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    """Where parameter `path` lives (models/loader.py reads each device's shard of it on its own)."""
    return NamedSharding(mesh, param_spec(mesh, path, shape))


def place(x, sharding: NamedSharding) -> jax.Array:
    """`x` laid out per `sharding`. With several processes (multi-host) each one builds only its own
    devices' shards, sliced from its local copy of `x` (`jax.device_put` would first check that every
    process holds the same value, a collective per array)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index]))


def shard_params(mesh: Mesh, params):
    """Places every parameter of an nnx State per `PARAM_AXES` (those the loader already placed so stay);
    returns the placed State."""
    from flax import nnx

    flat = []
    for path, var in nnx.to_flat_state(params):
        path = tuple(str(p) for p in path)
        sharding = param_sharding(mesh, path, var.shape)
        value = var[...]
        if not (isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim)):
            value = place(value, sharding)
        flat.append((path, var.replace(value)))
    return nnx.from_flat_state(flat)


def per_device_cache_spec(mesh: Mesh | None, spec: CacheSpec) -> CacheSpec:
    """`spec` as one device holds it under `mesh`'s tensor parallelism (the memory plan's view): KV heads and,
    with `split_heads`, recurrent states split where `pool_specs` splits them; whole where they do not divide.
    Pages and slots are not split over tensor parallelism (data parallelism sizes each rank's own)."""
    if mesh is None:
        return spec

    def part(n: int) -> int:  # n heads (or channels) on one device, as _spec splits a dim of that size
        count = int(np.prod([mesh.shape[a] for a in _mesh_axes(mesh)["heads"]]))
        return n // count if n % count == 0 else n

    rec = spec.recurrent
    if rec is not None and rec.split_heads:
        rec = dataclasses.replace(rec, ssm_shape=(part(rec.ssm_shape[0]), *rec.ssm_shape[1:]),
                                  conv_shape=None if rec.conv_shape is None
                                  else (part(rec.conv_shape[0]), *rec.conv_shape[1:]))
    heads = spec.num_kv_heads if spec.latent_kv or not spec.has_kv else part(spec.num_kv_heads)
    return dataclasses.replace(spec, num_kv_heads=heads, recurrent=rec)


def pool_specs(mesh: Mesh, pools: MemoryPools, *, data_only: bool = False,
               split_heads: bool = False) -> MemoryPools:
    """A `MemoryPools` of PartitionSpecs: the slot axis split over `data` (when dp > 1) and, unless
    `data_only` (the specs `shard_map` takes, which name only its manual axes), KV heads split where they
    divide, and with `split_heads` (RecurrentSpec.split_heads) the recurrent states' heads too."""
    split_data = mesh.shape["data"] > 1

    def spec(x, field: str, logical=None):
        parts = [None] * x.ndim
        if logical and not data_only:
            parts = list(_spec(mesh, x.shape, logical))
        if split_data:
            parts[POOL_DATA_AXIS[field]] = "data"
        return PartitionSpec(*parts)

    kv = pools.kv
    if kv is not None:
        v = None if kv.v is None else spec(kv.v, "kv", POOL_AXES["kv"])
        kv = type(kv)(spec(kv.k, "kv", POOL_AXES["kv"]), v, kv.page_size)
    def states(pool, field: str):
        if pool is None:
            return None
        return type(pool)(*(None if x is None else spec(x, field, POOL_AXES[part] if split_heads else None)
                            for part, x in (("ssm", pool.ssm), ("conv", pool.conv))))

    return MemoryPools(kv, jax.tree.map(lambda x: spec(x, "penalty"), pools.penalty),
                       states(pools.recurrent, "recurrent"), states(pools.snapshots, "snapshots"))


def shard_pools(mesh: Mesh, pools: MemoryPools, *, split_heads: bool = False) -> MemoryPools:
    """KV (and with `split_heads` recurrent states) split over heads where they divide, every pool's slot
    axis over `data`; the rest replicated."""
    specs = pool_specs(mesh, pools, split_heads=split_heads)
    return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), pools, specs)


def bytes_on_first_device(tree) -> int:
    """Bytes of `tree`'s arrays that live on the first device of their sharding this process addresses
    (per-device footprint)."""
    total = 0
    for x in jax.tree.leaves(tree):
        devices = x.sharding.addressable_devices
        first = devices and min(devices, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == first)
    return total
