"""Expert-parallel fused MoE for TPU: experts sharded over a mesh axis, token rows moved by remote DMA.

Under `shard_map` every device holds T/P tokens (x, weights, experts sharded on tokens) and E/P experts
(weights sharded on experts) of the mesh axis ("expert", P devices). One `pallas_call` per device:

1. Dispatch. After a barrier (every device is inside the kernel, so its receive buffer is live), the
   device issues one remote row DMA per (token, expert) assignment: x[token] goes to row `dest_pos` of
   the owner's receive buffer, laid out by (owner's local expert, source device), so each local expert's
   rows are contiguous. Each DMA signals the owner's semaphore of that expert. The row counts that make
   these offsets (an [P, E] count matrix) are all-gathered in jnp before the kernel: scalars, not payload.
2. Experts, overlapped with the traffic. The grid is (local expert slot, token tile, intermediate tile),
   with expert weights streamed through double-buffered VMEM tiles as in `kernels.moe.pallas` (non-empty
   experts compacted first; idle slots and tiles keep the resident weight block and skip the body). A
   slot waits only for its own expert's rows, so later experts' rows are still in flight while earlier
   experts compute. After a token tile's last intermediate tile its float32 rows are DMA'd straight back
   to the source devices (row `src_row` of their return buffer) while the next tiles compute; the
   accumulator is double-buffered and a buffer is reused only after its sends completed.
3. Combine. At the last step the device waits for its own sends and for all of its rows to come back,
   then adds each returned row times its routing weight to its token's row of the output (float32).

Numerics are those of `kernels.moe.pallas` / `reference.experts_ffn` (rows return in float32, so the
combine is exactly the single-device one up to summation order).

Limits, sized for decode and moderate prefill batches: the whole local output [T/P, D] f32 stays in
VMEM; the receive buffer has room for the worst case (all T tokens on one device's experts) and its
source map sits in SMEM (two words per row); with several intermediate tiles an expert's weights stream
once per token tile (the accumulator holds one token tile, not all of the expert's rows); a token tile's
copy from the receive buffer into VMEM is not prefetched. The shared expert is not part of this variant
(it is dense: run it data-parallel beside this call). Tested only in the TPU interpreter (with its race
detector) on fake CPU devices; the barrier uses `collective_id=0`.

Not selectable with `--kernel-backend` (only tests call it), on purpose: the served step keeps `expert` an
automatic (GSPMD) mesh axis with every token replicated over it (runtime/step.py `per_rank` is manual over
`data` only), while this kernel needs a `shard_map` manual over `expert` with tokens split across its
devices, and it has never run on a TPU. Wiring it in means making the MoE layer manual over `expert`
(token split before, all-gather after) and checking it on real hardware first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.moe.pallas import Tiles, _expert_tiles, tiles_for
from kernels.moe.reference import ACTIVATIONS

AXIS = "expert"


def _ep_plan(weights, experts, num_experts: int, axis: str):
    """Per-device schedule (all 1-D, for SMEM); see the module docstring for the layouts.

    Returns (send_dev, send_pos, send_expert, row_token, row_weight) over this device's A = T_l*k
    sorted assignments, (slot_expert, slot_mode, group_start, group_count, num_active) over its local
    experts, and (src_dev, src_row) over the rows it may receive.
    """
    num_local_tokens, top_k = experts.shape
    num_devices = lax.axis_size(axis)
    me = lax.axis_index(axis)
    local = num_experts // num_devices
    flat = experts.reshape(-1).astype(jnp.int32)  # i32[A] global expert of each assignment
    order = jnp.argsort(flat, stable=True)  # i32[A]
    sorted_expert = flat[order]
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # i32[E] rows this device sends
    all_counts = lax.all_gather(counts, axis)  # i32[P, E]: rows from source s to expert g
    src_start = jnp.cumsum(all_counts, axis=1) - all_counts  # i32[P, E] first sorted row of (s, g) at s
    # Receive layout of device q: (local expert e, source s) chunks in that order.
    chunk = all_counts.reshape(num_devices, num_devices, local).transpose(1, 2, 0)  # i32[q, e, s]
    flat_chunk = chunk.reshape(num_devices, local * num_devices)
    chunk_start = (jnp.cumsum(flat_chunk, axis=1) - flat_chunk).reshape(chunk.shape)  # i32[q, e, s]

    dest = sorted_expert // local
    dest_expert = sorted_expert % local
    rank = jnp.arange(flat.size, dtype=jnp.int32) - src_start[me, sorted_expert]  # within (me, g) group
    send_pos = chunk_start[dest, dest_expert, me] + rank
    row_token = (order // top_k).astype(jnp.int32)
    row_weight = weights.reshape(-1)[order].astype(jnp.float32)

    # My experts: contiguous groups; non-empty ones compacted first (as in kernels.moe.pallas._plan).
    group_count = chunk[me].sum(axis=1)  # i32[E_l]
    group_start = chunk_start[me, :, 0]
    active = jnp.argsort(group_count == 0, stable=True).astype(jnp.int32)
    num_active = (group_count > 0).sum().astype(jnp.int32)
    in_use = jnp.arange(local) < num_active
    last = active[jnp.maximum(num_active - 1, 0)]
    slot_expert = jnp.where(in_use, active, last)
    slot_mode = jnp.where(in_use, 1, 2).astype(jnp.int32)

    # Source of each row I may receive: the (e, s) chunk holding it, and its sorted row at the source.
    capacity = num_devices * num_local_tokens * min(top_k, local)
    u = jnp.arange(capacity, dtype=jnp.int32)
    c = jnp.clip(
        jnp.searchsorted(chunk_start[me].reshape(-1), u, side="right") - 1, 0, local * num_devices - 1
    )
    src_dev = (c % num_devices).astype(jnp.int32)
    src_expert = me * local + c // num_devices
    src_row = src_start[src_dev, src_expert] + u - chunk_start[me].reshape(-1)[c]
    return (
        dest.astype(jnp.int32),
        send_pos.astype(jnp.int32),
        dest_expert.astype(jnp.int32),
        row_token,
        row_weight,
        slot_expert.astype(jnp.int32),
        slot_mode,
        group_start.astype(jnp.int32),
        group_count.astype(jnp.int32),
        num_active.reshape(1),
        src_dev,
        src_row.astype(jnp.int32),
    )


def _ep_kernel(
    # scalar prefetch (SMEM)
    send_dev, send_pos, send_expert, row_token, row_weight,
    slot_expert, slot_mode, group_start, group_count, num_active, src_dev, src_row,
    # inputs, outputs, scratch
    *refs,
    axis: str,
    num_devices: int,
    num_tiles_t: int,
    nf: int,
    tile_tokens: int,
    quantized: bool,
    compute,
    act: str,
):  # fmt: skip
    """One grid step (local expert slot i, token tile t, intermediate tile j); see the module docstring."""
    refs = list(refs)
    x_hbm, w_gate, w_up, w_down = refs[:4]
    del refs[:4]
    scales = None
    if quantized:
        scales = tuple(refs[:3])
        del refs[:3]
    # out f32[T_l, D] (VMEM, resident); recv_x x[capacity, D] and ret f32[A_pad, D] (HBM, DMA targets);
    # stage x[bt, D]; acc f32[2, bt, D]; pending i32[2] (SMEM): return sends in flight from each acc buffer.
    out, recv_x, ret, stage, acc, copy_sem, x_send, x_recv, y_send, ret_sem, pending = refs
    num_slots = pl.num_programs(0)
    num_rows = row_token.shape[0]
    i, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    me = lax.axis_index(axis)
    expert = slot_expert[i]
    count, start = group_count[expert], group_start[expert]
    slot_live = i < num_active[0]
    tile_live = slot_live & (t * tile_tokens < count)
    buf = (i * num_tiles_t + t) % 2

    def remote(src, dst, send_sem, recv_sem, device):
        return pltpu.make_async_remote_copy(
            src, dst, send_sem, recv_sem, device_id={axis: device}, device_id_type=pl.DeviceIdType.MESH
        )

    def repeat(n, fn):
        lax.fori_loop(0, n, lambda k, carry: (fn(k), carry)[1], 0)

    def drain(b):  # wait for the return sends from acc buffer b
        desc = remote(acc.at[b, pl.ds(0, 1)], ret.at[pl.ds(0, 1)], y_send.at[b], ret_sem, me)
        repeat(pending[b], lambda _: desc.wait_send())
        pending[b] = 0

    @pl.when((i == 0) & (t == 0) & (j == 0))
    def _():
        with jax.named_scope("ep_barrier"):  # every device is in the kernel: its buffers are live
            barrier = pltpu.get_barrier_semaphore()
            for device in range(num_devices):
                pl.semaphore_signal(barrier, 1, device_id={axis: device}, device_id_type=pl.DeviceIdType.MESH)
            pl.semaphore_wait(barrier, num_devices)
        pending[0] = pending[1] = 0
        with jax.named_scope("ep_dispatch"):

            def send(r):
                remote(
                    x_hbm.at[pl.ds(row_token[r], 1)],
                    recv_x.at[pl.ds(send_pos[r], 1)],
                    x_send,
                    x_recv.at[send_expert[r]],
                    send_dev[r],
                ).start()

            repeat(num_rows, send)

    @pl.when(slot_live & (t == 0) & (j == 0))
    def _():  # this expert's rows have all arrived (later experts' rows may still be in flight)
        desc = remote(x_hbm.at[pl.ds(0, 1)], recv_x.at[pl.ds(0, 1)], x_send, x_recv.at[expert], me)
        repeat(count, lambda _: desc.wait_recv())

    @pl.when(tile_live & (j == 0))
    def _():
        drain(buf)  # acc[buf] is about to be overwritten
        first = start + t * tile_tokens
        rows = jnp.minimum(tile_tokens, count - t * tile_tokens)

        @pl.when(rows == tile_tokens)
        def _():  # a full tile: one copy
            copy = pltpu.make_async_copy(recv_x.at[pl.ds(first, tile_tokens)], stage, copy_sem)
            copy.start()
            copy.wait()

        @pl.when(rows < tile_tokens)
        def _():  # a group's last, partial tile: row by row, never touching the next group's rows, which
            # may still be in flight (a read racing their DMA: harmless garbage, but a race all the same)
            def row_copy(r):
                return pltpu.make_async_copy(recv_x.at[pl.ds(first + r, 1)], stage.at[pl.ds(r, 1)], copy_sem)

            repeat(rows, lambda r: row_copy(r).start())
            repeat(rows, lambda r: row_copy(0).wait())

    @pl.when(tile_live)
    def _():
        scale = None if scales is None else tuple(r[...] for r in scales)
        y = _expert_tiles(stage[...].astype(compute), w_gate[...], w_up[...], w_down[...], scale, act)
        acc[buf] = jnp.where(j == 0, y, acc[buf] + y)

        @pl.when(j == nf - 1)
        def _():
            with jax.named_scope("ep_return"):
                rows = jnp.minimum(tile_tokens, count - t * tile_tokens)
                first = start + t * tile_tokens

                def send_back(r):
                    u = first + r
                    remote(
                        acc.at[buf, pl.ds(r, 1)],
                        ret.at[pl.ds(src_row[u], 1)],
                        y_send.at[buf],
                        ret_sem,
                        src_dev[u],
                    ).start()

                repeat(rows, send_back)
                pending[buf] = rows

    @pl.when((i == num_slots - 1) & (t == num_tiles_t - 1) & (j == pl.num_programs(2) - 1))
    def _():
        with jax.named_scope("ep_wait"):
            sent = remote(x_hbm.at[pl.ds(0, 1)], recv_x.at[pl.ds(0, 1)], x_send, x_recv.at[0], me)
            repeat(num_rows, lambda _: sent.wait_send())
            drain(0)
            drain(1)
            back = remote(acc.at[0, pl.ds(0, 1)], ret.at[pl.ds(0, 1)], y_send.at[0], ret_sem, me)
            repeat(num_rows, lambda _: back.wait_recv())
        with jax.named_scope("ep_combine"):
            out[...] = jnp.zeros_like(out)

            def chunk(c):
                copy = pltpu.make_async_copy(ret.at[pl.ds(c * tile_tokens, tile_tokens)], acc.at[0], copy_sem)
                copy.start()
                copy.wait()

                def add(r):
                    row = c * tile_tokens + r
                    out[pl.ds(row_token[row], 1), :] += row_weight[row] * acc[0, pl.ds(r, 1), :]

                repeat(jnp.minimum(tile_tokens, num_rows - c * tile_tokens), add)

            repeat(pl.cdiv(num_rows, tile_tokens), chunk)


def _local_experts_ffn(
    x, weights, experts, w_gate_up, w_down, *scales, num_experts, axis, tiles, act, interpret
) -> jax.Array:
    """The per-device body under shard_map: plan in jnp, then the kernel."""
    num_local_tokens, hidden = x.shape
    local, _, two_f = w_gate_up.shape
    intermediate = two_f // 2
    num_devices = num_experts // local
    top_k = experts.shape[1]
    quantized = bool(scales)
    compute = x.dtype if quantized else w_gate_up.dtype
    _, tt, tf = tiles
    nf = intermediate // tf
    num_rows = num_local_tokens * top_k
    capacity = num_devices * num_local_tokens * min(top_k, local)
    num_tiles_t = pl.cdiv(num_devices * num_local_tokens, tt)  # an expert receives each token at most once
    plan = _ep_plan(weights, experts, num_experts, axis)

    def weight_tile(i, t, j, *plan_refs):
        slot_expert, slot_mode, group_count = plan_refs[5], plan_refs[6], plan_refs[8]
        e = slot_expert[i]
        live = (slot_mode[i] == 1) & (t * tt < group_count[e])
        return e, jnp.where(live, j, nf - 1)

    def gate_map(i, t, j, *plan_refs):
        e, f = weight_tile(i, t, j, *plan_refs)
        return e, 0, f

    def up_map(i, t, j, *plan_refs):
        e, f = weight_tile(i, t, j, *plan_refs)
        return e, 0, nf + f

    def down_map(i, t, j, *plan_refs):
        e, f = weight_tile(i, t, j, *plan_refs)
        return e, f, 0

    squeezed = pl.Squeezed()
    in_specs = [
        pl.BlockSpec(memory_space=pl.ANY),
        pl.BlockSpec((squeezed, hidden, tf), gate_map),
        pl.BlockSpec((squeezed, hidden, tf), up_map),
        pl.BlockSpec((squeezed, tf, hidden), down_map),
    ]
    operands = [x, w_gate_up, w_gate_up, w_down]
    if quantized:
        gate_up_scale = scales[0].astype(jnp.float32).reshape(local, 1, two_f)
        in_specs += [
            pl.BlockSpec((squeezed, 1, tf), gate_map),
            pl.BlockSpec((squeezed, 1, tf), up_map),
            pl.BlockSpec((squeezed, 1, hidden), lambda i, t, j, *r: (weight_tile(i, t, j, *r)[0], 0, 0)),
        ]
        operands += [gate_up_scale, gate_up_scale, scales[1].astype(jnp.float32).reshape(local, 1, hidden)]
    kernel = functools.partial(
        _ep_kernel,
        axis=axis,
        num_devices=num_devices,
        num_tiles_t=num_tiles_t,
        nf=nf,
        tile_tokens=tt,
        quantized=quantized,
        compute=compute,
        act=act,
    )
    out, _, _ = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_local_tokens, hidden), jnp.float32),
            jax.ShapeDtypeStruct((capacity, hidden), x.dtype),  # rows received for my experts
            jax.ShapeDtypeStruct((pl.cdiv(num_rows, tt) * tt, hidden), jnp.float32),  # my rows, returned
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(plan),
            grid=(local, num_tiles_t, nf),
            in_specs=in_specs,
            out_specs=(
                pl.BlockSpec((num_local_tokens, hidden), lambda *_: (0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ),
            scratch_shapes=[
                pltpu.VMEM((tt, hidden), x.dtype),  # one token tile of received rows
                pltpu.VMEM((2, tt, hidden), jnp.float32),  # tile outputs summed over F tiles, double-buffered
                pltpu.SemaphoreType.DMA,  # local copies
                pltpu.SemaphoreType.DMA,  # dispatch sends
                pltpu.SemaphoreType.DMA((local,)),  # dispatch receives, per local expert
                pltpu.SemaphoreType.DMA((2,)),  # return sends, per acc buffer
                pltpu.SemaphoreType.DMA,  # return receives
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",) * 3, collective_id=0),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="fused_moe_ep",
    )(*plan, *operands)
    return out


def experts_ffn_ep(
    x: jax.Array,  # f[T, D], sharded on T over `axis`
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k] global expert ids
    w_gate_up: jax.Array,  # [E, D, 2F], sharded on E over `axis`
    w_down: jax.Array,  # [E, F, D]
    *,
    mesh: Mesh,
    act: str = "silu",
    gate_up_scale: jax.Array | None = None,  # f32[E, 2F]
    down_scale: jax.Array | None = None,  # f32[E, D]
    tiles: Tiles | None = None,
    axis: str = AXIS,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`reference.experts_ffn` with experts sharded over mesh axis `axis`: f32[T, D], sharded on T.

    T and E must be multiples of the axis size. `tiles`: only tile_tokens and tile_f are used (default
    `kernels.moe.pallas.tiles_for`). `interpret`: as in `kernels.moe.pallas.experts_ffn`.
    """
    num_tokens, hidden = x.shape
    num_experts, _, two_f = w_gate_up.shape
    num_devices = mesh.shape[axis]
    if num_tokens % num_devices or num_experts % num_devices:
        raise ValueError(
            f"{num_tokens=} and {num_experts=} must be multiples of the {axis!r} axis ({num_devices})"
        )
    if w_down.shape != (num_experts, two_f // 2, hidden):
        raise ValueError(f"w_down shape {w_down.shape} != ({num_experts}, {two_f // 2}, {hidden})")
    if weights.shape != experts.shape or experts.shape[0] != num_tokens:
        raise ValueError(f"weights {weights.shape} and experts {experts.shape} must be ({num_tokens}, k)")
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("give both gate_up_scale and down_scale, or neither")
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown {act=}; known: {', '.join(ACTIVATIONS)}")
    tiles = tiles or tiles_for(num_tokens, hidden, two_f // 2, num_experts, x.dtype, w_gate_up.dtype)
    if (two_f // 2) % tiles.tile_f:
        raise ValueError(f"{tiles=}: tile_f must divide F={two_f // 2}")
    scales = () if gate_up_scale is None else (gate_up_scale, down_scale)
    return _sharded(
        x, weights, experts, w_gate_up, w_down, *scales, mesh=mesh, tiles=tiles, act=act, axis=axis,
        interpret=interpret,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("mesh", "tiles", "act", "axis", "interpret"))
def _sharded(*args, mesh, tiles, act, axis, interpret):
    """The shard_map, jitted: eager shard_map would compile each jnp op of the plan on its own."""
    spec = PartitionSpec(axis)
    num_experts = args[3].shape[0]
    body = functools.partial(
        _local_experts_ffn, num_experts=num_experts, axis=axis, tiles=tiles, act=act, interpret=interpret
    )
    args = [jax.reshard(a, NamedSharding(mesh, spec)) for a in args]
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)(
        *args
    )
