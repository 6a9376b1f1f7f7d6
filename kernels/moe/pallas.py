"""Fused dropless top-k MoE for TPU: one `pallas_call` gathers routed tokens, runs the experts, combines.

Layout of the work. The T*k (token, expert) assignments are sorted in jnp by (token block, expert): a
token block is `block_tokens` consecutive tokens whose float32 outputs stay resident in VMEM as one
output block. The grid is (token block b, expert slot i, intermediate tile j), all sequential
("arbitrary"): slot i of block b is the i-th expert that block's tokens use (the non-empty experts are
compacted to the front in jnp), or, with a shared expert, slot 0 is the shared expert over every token of
the block. The sort, group offsets and compacted expert list are scalar-prefetched into SMEM.

Weights stream. The gate, up and down tiles of the slot's expert (`w_gate_up[e][:, j*tf:(j+1)*tf]`,
its up twin at column F + j*tf, `w_down[e][j*tf:(j+1)*tf]`) are BlockSpec blocks whose index maps read
the compacted expert list, so Pallas's pipeline fetches the next step's tiles into the second VMEM buffer
while this step computes (double buffering). Zero-token experts cost no DMA and no compute: they are not
in the compacted list, and the slots past a block's last expert map every weight to the tile already
resident (an unchanged block index is not fetched again) and skip the body, leaving an empty grid step.

Tokens. At a slot's first tile the slot's rows (x of each routed token, one row DMA each, from HBM) are
already in VMEM: they were gathered into the other half of a double buffer while the previous slot
computed. The slot's rows are processed `tile_tokens` at a time: gate and up dots, activation, down dot,
accumulated over the intermediate tiles in a float32 scratch; after the slot's last tile each row is
added, times its routing weight, to its token's row of the resident output block (the combine). The
shared expert's rows are the block's tokens in order, added with weight one.

Numerics follow `reference.experts_ffn`: dots in the weights' dtype (or x's for int8/fp8 weights, widened
in VMEM) with float32 accumulation, per-output-channel scales after the dot, float32 combine; float32
dots ask for HIGHEST precision. Sums run in another order than the reference's (over intermediate tiles,
and over a token's experts by expert id), so results agree to float32 rounding, not bit for bit.

TPU lowering constraints (checked when not interpreting): `tile_f` divides F and is a multiple of 128
(F itself a multiple of 128), so gate and up tiles are lane-aligned column blocks of [D, 2F];
`tile_tokens` divides `block_tokens`, both multiples of 16. Unverified on hardware (no TPU was
available): single-row DMAs of a packed dtype (bf16 x) at odd rows, which tpu-inference avoids with a
(T, packing, D / packing) view of x; and the schedule's SMEM footprint, which grows with T*k (two words
per assignment): very large prefill batches may need the call split into token chunks.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.moe.reference import ACTIVATIONS


class Tiles(NamedTuple):
    """Tile sizes of the fused MoE kernel."""

    block_tokens: int  # tokens per output block: the unit of routing; its f32 output rows stay in VMEM
    tile_tokens: int  # rows of one expert's tokens per matmul (staging) tile; divides block_tokens
    tile_f: int  # intermediate columns per streamed weight tile; divides F


# (hidden, moe intermediate, num_experts, "decode" | "prefill") -> Tiles. PLACEHOLDERS, not measured: no
# TPU was available when they were written. They follow the VMEM arithmetic of `_default_tiles` for
# known MoE shapes (Qwen3-30B-A3B, Qwen1.5/Qwen2-MoE, Mixtral-8x7B, DeepSeek-V3 / Ling) and MXU-sized
# (128 / 256) token tiles; replace them with `bench/` sweeps on v5e / v6e before trusting them.
TUNED_TILES: dict[tuple[int, int, int, str], Tiles] = {
    (2048, 768, 128, "decode"): Tiles(64, 64, 768),
    (2048, 768, 128, "prefill"): Tiles(512, 128, 768),
    (2048, 1408, 60, "decode"): Tiles(64, 64, 1408),
    (2048, 1408, 60, "prefill"): Tiles(512, 128, 1408),
    (3584, 2560, 64, "decode"): Tiles(64, 64, 512),
    (3584, 2560, 64, "prefill"): Tiles(256, 128, 512),
    (4096, 14336, 8, "decode"): Tiles(64, 64, 512),
    (4096, 14336, 8, "prefill"): Tiles(256, 256, 512),
    (7168, 2048, 256, "decode"): Tiles(64, 64, 256),
    (7168, 2048, 256, "prefill"): Tiles(128, 128, 256),
}
DECODE_MAX_TOKENS = 128  # batches up to this many tokens use the "decode" entries
_WEIGHT_VMEM = 16 << 20  # bytes of double-buffered gate/up/down tiles the default tiles aim for
_TOKEN_VMEM = 16 << 20  # bytes of staged x, f32 accumulator and f32 output block the default tiles aim for
_ROWS = 16  # token-dim alignment: a bf16 sublane tile


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _default_tiles(hidden: int, intermediate: int, x_bytes: int, w_bytes: int) -> Tiles:
    """VMEM-sized tiles: the largest lane-aligned tile_f whose double-buffered tiles fit _WEIGHT_VMEM
    (F whole when it is no multiple of 128), and block_tokens whose buffers fit _TOKEN_VMEM."""
    tile_f = intermediate
    if intermediate % 128 == 0:
        for cand in (1024, 512, 256, 128):
            if intermediate % cand == 0 and 2 * 3 * hidden * cand * w_bytes <= _WEIGHT_VMEM:
                tile_f = cand
                break
        else:
            tile_f = 128
    # Per token row: two staging buffers of x, the f32 accumulator, a double-buffered f32 output block.
    rows = _TOKEN_VMEM // (hidden * (2 * x_bytes + 4 + 2 * 4))
    block = max(_ROWS, min(512, 1 << max(rows, 1).bit_length() - 1))
    return Tiles(block, min(block, 128), tile_f)


def tiles_for(num_tokens: int, hidden: int, intermediate: int, num_experts: int, x_dtype, w_dtype) -> Tiles:
    """Tile sizes for this shape: TUNED_TILES' entry if any, else `_default_tiles`; then fitted to the
    batch (block_tokens no larger than the tokens rounded up to 16, tile_tokens dividing it) and to F."""
    bucket = "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"
    tiles = TUNED_TILES.get((hidden, intermediate, num_experts, bucket)) or _default_tiles(
        hidden, intermediate, jnp.dtype(x_dtype).itemsize, jnp.dtype(w_dtype).itemsize
    )
    block = min(tiles.block_tokens, _round_up(max(num_tokens, 1), _ROWS))
    tile = min(tiles.tile_tokens, block)
    tile_f = tiles.tile_f if intermediate % tiles.tile_f == 0 else intermediate
    return Tiles(_round_up(block, tile), tile, tile_f)


class _Plan(NamedTuple):
    """Scalar-prefetched schedule (SMEM, all 1-D). S = expert slots per block (E, plus 1 with a shared
    expert); entries [b * S + i] describe slot i of token block b."""

    weight_expert: jax.Array  # i32[nb * S] expert whose routed weight tiles are resident at slot i
    weight_mode: jax.Array  # i32[nb * S] routed weight tile at (b, i, j): 0 first, 1 min(j, nF-1), 2 last
    slot_start: jax.Array  # i32[nb * S] first sorted row of the slot (shared slot: first token of block)
    slot_count: jax.Array  # i32[nb * S] rows (tokens) of the slot; 0 past the block's last slot
    num_slots: jax.Array  # i32[nb] slots in use in each block
    row_token: jax.Array  # i32[T*k] token of each sorted row
    row_weight: jax.Array  # f32[T*k] routing weight of each sorted row


def _plan(weights: jax.Array, experts: jax.Array, num_experts: int, block_tokens: int, shared: bool) -> _Plan:
    """Sorts the assignments by (token block, expert) and lists each block's non-empty experts first."""
    num_tokens, top_k = experts.shape
    num_blocks = pl.cdiv(num_tokens, block_tokens)
    block_of = jnp.arange(num_tokens, dtype=jnp.int32) // block_tokens  # i32[T]
    key = (block_of[:, None] * num_experts + experts.astype(jnp.int32)).reshape(-1)  # i32[T*k]
    order = jnp.argsort(key, stable=True)  # i32[T*k] assignment of each sorted row
    counts = jnp.bincount(key, length=num_blocks * num_experts).reshape(num_blocks, num_experts)
    starts = (jnp.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(num_blocks, num_experts)
    # Non-empty experts first, in expert order: argsort of "empty" is stable.
    active = jnp.argsort(counts == 0, axis=1, stable=True).astype(jnp.int32)  # i32[nb, E]
    num_active = (counts > 0).sum(axis=1).astype(jnp.int32)  # i32[nb], >= 1: a block has tokens
    slot = jnp.arange(num_experts, dtype=jnp.int32)[None, :]
    in_use = slot < num_active[:, None]
    last = jnp.take_along_axis(active, num_active[:, None] - 1, axis=1)  # i32[nb, 1] last non-empty expert
    weight_expert = jnp.where(in_use, active, last)
    weight_mode = jnp.where(in_use, 1, 2)
    slot_start = jnp.take_along_axis(starts, active, axis=1)
    slot_count = jnp.where(in_use, jnp.take_along_axis(counts, active, axis=1), 0)
    if shared:  # slot 0: the shared expert over the block's tokens; routed tiles prefetch the first expert
        first_token = jnp.arange(num_blocks, dtype=jnp.int32)[:, None] * block_tokens
        weight_expert = jnp.concatenate([active[:, :1], weight_expert], axis=1)
        weight_mode = jnp.concatenate([jnp.zeros_like(first_token), weight_mode], axis=1)
        slot_start = jnp.concatenate([first_token, slot_start], axis=1)
        slot_count = jnp.concatenate(
            [jnp.minimum(block_tokens, num_tokens - first_token), slot_count], axis=1
        )
        num_active = num_active + 1
    return _Plan(
        weight_expert.reshape(-1).astype(jnp.int32),
        weight_mode.reshape(-1).astype(jnp.int32),
        slot_start.reshape(-1).astype(jnp.int32),
        slot_count.reshape(-1).astype(jnp.int32),
        num_active,
        (order // top_k).astype(jnp.int32),
        weights.reshape(-1)[order].astype(jnp.float32),
    )


def _routed_tile(b, i, j, weight_expert, weight_mode, *_, num_slots_max: int, nf: int):
    """(expert, F tile) of the routed weight blocks at grid step (b, i, j): the index maps' core."""
    s = b * num_slots_max + i
    mode = weight_mode[s]
    return weight_expert[s], jnp.where(mode == 1, jnp.minimum(j, nf - 1), jnp.where(mode == 0, 0, nf - 1))


def routed_weight_blocks(
    weights: jax.Array,
    experts: jax.Array,
    num_experts: int,
    intermediate: int,
    tiles: Tiles,
    shared: bool = False,
) -> list[tuple[int, int]]:
    """The (expert, F tile) weight blocks the kernel's pipeline fetches, in order, for this routing.

    Pallas fetches a block when its index differs from the previous grid step's, so these are the
    consecutive-distinct indices of `_routed_tile` over the grid (for tests and benchmarks: the weight
    traffic is len(result) * 3 tiles).
    """
    nf = intermediate // tiles.tile_f
    num_slots_max = num_experts + shared
    plan = _plan(weights, experts, num_experts, tiles.block_tokens, shared)
    fetched: list[tuple[int, int]] = []
    for b in range(pl.cdiv(experts.shape[0], tiles.block_tokens)):
        for i in range(num_slots_max):
            for j in range(nf):  # routed blocks only change over their own nf tiles
                e, t = _routed_tile(
                    b, i, j, plan.weight_expert, plan.weight_mode, num_slots_max=num_slots_max, nf=nf
                )
                if not fetched or fetched[-1] != (int(e), int(t)):
                    fetched.append((int(e), int(t)))
    return fetched


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _expert_tiles(
    x_tile: jax.Array,  # f[bt, D] in the compute dtype
    w_gate: jax.Array,  # [D, tf]
    w_up: jax.Array,  # [D, tf]
    w_down: jax.Array,  # [tf, D]
    scales: tuple[jax.Array, jax.Array, jax.Array] | None,  # f32[1, tf], f32[1, tf], f32[1, D]
    act: str,
) -> jax.Array:
    """f32[bt, D]: one intermediate tile's share of the gated MLP of bt rows (linear in the tiles)."""
    compute = x_tile.dtype
    gate = _dot(x_tile, w_gate.astype(compute))  # f32[bt, tf]
    up = _dot(x_tile, w_up.astype(compute))
    if scales is not None:
        gate, up = gate * scales[0], up * scales[1]
    h = (ACTIVATIONS[act](gate) * up).astype(compute)
    y = _dot(h, w_down.astype(compute))  # f32[bt, D]
    return y if scales is None else y * scales[2]


def _row_copy(x_hbm, stage, sem, token, row):
    """DMA descriptor of x row `token` (HBM) into staging row `row` (VMEM)."""
    return pltpu.make_async_copy(x_hbm.at[pl.ds(token, 1)], stage.at[pl.ds(row, 1)], sem)


def _moe_kernel(
    # scalar prefetch (SMEM)
    weight_expert, weight_mode, slot_start, slot_count, num_slots, row_token, row_weight,
    # inputs, outputs, scratch
    *refs,
    num_slots_max: int,
    nf: int,
    nf_shared: int,
    shared: bool,
    quantized: bool,
    block_tokens: int,
    tile_tokens: int,
    compute,
    act: str,
):  # fmt: skip
    """One grid step (token block b, expert slot i, intermediate tile j); see the module docstring."""
    refs = list(refs)
    x_hbm, w_gate, w_up, w_down = refs[:4]
    del refs[:4]
    scales = None
    if quantized:
        scales = tuple(refs[:3])  # f32[1, tf] gate, f32[1, tf] up, f32[1, D] down of the slot's expert
        del refs[:3]
    if shared:
        s_gate, s_up, s_down = refs[:3]
        del refs[:3]
    out, stage, acc, sems = refs  # out f32[bt_out, D]; stage x[2, bt_out, D]; acc f32[bt_out, D]; DMA[2]
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = b * num_slots_max + i
    used = num_slots[b]

    def slot_token(s, row):  # token of row `row` of slot index s (the shared slot holds the block in order)
        if shared:
            return jnp.where(s % num_slots_max == 0, slot_start[s] + row, row_token[slot_start[s] + row])
        return row_token[slot_start[s] + row]

    def start_gather(s, buf):
        def body(row, carry):
            _row_copy(x_hbm, stage.at[buf], sems.at[buf], slot_token(s, row), row).start()
            return carry

        lax.fori_loop(0, slot_count[s], body, 0)

    @pl.when((i == 0) & (j == 0))
    def _():
        out[...] = jnp.zeros_like(out)
        start_gather(slot, 0)

    @pl.when((i < used) & (j == 0))
    def _():
        # Wait for this slot's rows (one wait per row DMA), then gather the next slot's into the other
        # buffer while this slot runs all its intermediate tiles.
        def wait(row, carry):
            _row_copy(x_hbm, stage.at[i % 2], sems.at[i % 2], 0, 0).wait()
            return carry

        lax.fori_loop(0, slot_count[slot], wait, 0)

        @pl.when(i + 1 < used)
        def _():
            start_gather(slot + 1, (i + 1) % 2)

    def run(gate_ref, up_ref, down_ref, scale_refs, num_tiles: int, is_shared: bool):
        count = slot_count[slot]
        buf = i % 2

        def tile(t, carry):
            rows = pl.ds(pl.multiple_of(t * tile_tokens, tile_tokens), tile_tokens)
            scale = None if scale_refs is None else tuple(r[...] for r in scale_refs)
            y = _expert_tiles(
                stage[buf, rows, :].astype(compute), gate_ref[...], up_ref[...], down_ref[...], scale, act
            )
            acc[rows, :] = jnp.where(j == 0, y, acc[rows, :] + y)
            return carry

        lax.fori_loop(0, pl.cdiv(count, tile_tokens), tile, 0)

        @pl.when(j == num_tiles - 1)
        def _():
            if is_shared:  # rows are the block's tokens in order, weight one; rows past `count` are stale
                live = lax.broadcasted_iota(jnp.int32, acc.shape, 0) < count
                out[...] += jnp.where(live, acc[...], 0.0)
            else:
                start = slot_start[slot]
                first_token = b * block_tokens

                def combine(row, carry):
                    token = row_token[start + row] - first_token
                    out[pl.ds(token, 1), :] += row_weight[start + row] * acc[pl.ds(row, 1), :]
                    return carry

                lax.fori_loop(0, count, combine, 0)

    routed = (i < used) & (j < nf)
    if shared:
        pl.when((i == 0) & (j < nf_shared))(lambda: run(s_gate, s_up, s_down, None, nf_shared, True))
        routed &= i > 0
    pl.when(routed)(lambda: run(w_gate, w_up, w_down, scales, nf, False))


def experts_ffn(
    x: jax.Array,  # f[T, D]
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k]
    w_gate_up: jax.Array,  # [E, D, 2F]
    w_down: jax.Array,  # [E, F, D]
    *,
    act: str = "silu",
    gate_up_scale: jax.Array | None = None,  # f32[E, 2F]
    down_scale: jax.Array | None = None,  # f32[E, D]
    shared_gate_up: jax.Array | None = None,  # [D, 2Fs]
    shared_down: jax.Array | None = None,  # [Fs, D]
    tiles: Tiles | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """`reference.experts_ffn` as one fused Pallas TPU kernel: f32[T, D].

    `tiles`: tile sizes (default `tiles_for` the shape; the shared expert uses the largest divisor of Fs
    not above tile_f). `interpret`: True runs the TPU interpreter (`pltpu.InterpretParams()`; the kernel
    uses DMAs and semaphores, which plain interpret mode lacks), or pass InterpretParams.
    """
    num_tokens, hidden = x.shape
    num_experts, _, two_f = w_gate_up.shape
    intermediate = two_f // 2
    if w_down.shape != (num_experts, intermediate, hidden):
        raise ValueError(f"w_down shape {w_down.shape} != ({num_experts}, {intermediate}, {hidden})")
    if weights.shape != experts.shape or experts.shape[0] != num_tokens:
        raise ValueError(f"weights {weights.shape} and experts {experts.shape} must be ({num_tokens}, k)")
    quantized = gate_up_scale is not None
    if quantized != (down_scale is not None):
        raise ValueError("give both gate_up_scale and down_scale, or neither")
    shared = shared_gate_up is not None
    if shared != (shared_down is not None):
        raise ValueError("give both shared_gate_up and shared_down, or neither")
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown {act=}; known: {', '.join(ACTIVATIONS)}")
    compute = x.dtype if quantized else w_gate_up.dtype
    if num_tokens == 0:
        return jnp.zeros((0, hidden), jnp.float32)

    tiles = tiles or tiles_for(num_tokens, hidden, intermediate, num_experts, x.dtype, w_gate_up.dtype)
    block, tt, tf = tiles
    if intermediate % tf or block % tt:
        raise ValueError(f"{tiles=}: tile_f must divide F={intermediate} and tile_tokens block_tokens")
    nf = intermediate // tf
    shared_f = tf_shared = nf_shared = 0
    if shared:
        shared_f = shared_down.shape[0]
        if shared_gate_up.shape != (hidden, 2 * shared_f) or shared_down.shape != (shared_f, hidden):
            raise ValueError(
                f"shared_gate_up {shared_gate_up.shape} / shared_down {shared_down.shape} must be "
                f"({hidden}, 2Fs) / (Fs, {hidden})"
            )
        tf_shared = math.gcd(shared_f, tf) if shared_f % tf else tf
        nf_shared = shared_f // tf_shared
    if not interpret and (intermediate % 128 or tf % 128 or (shared and tf_shared % 128) or block % _ROWS):
        raise ValueError(
            f"TPU lowering needs F={intermediate}, tile_f={tf} (and the shared tile {tf_shared}) multiples of"
            f" 128 and block_tokens={block} a multiple of {_ROWS}"
        )
    num_blocks = pl.cdiv(num_tokens, block)
    num_slots_max = num_experts + shared
    plan = _plan(weights, experts, num_experts, block, shared)

    routed_tile = functools.partial(_routed_tile, num_slots_max=num_slots_max, nf=nf)

    def gate_map(b, i, j, *plan_refs):
        e, t = routed_tile(b, i, j, *plan_refs)
        return e, 0, t

    def up_map(b, i, j, *plan_refs):
        e, t = routed_tile(b, i, j, *plan_refs)
        return e, 0, nf + t

    def down_map(b, i, j, *plan_refs):
        e, t = routed_tile(b, i, j, *plan_refs)
        return e, t, 0

    def down_scale_map(b, i, j, *plan_refs):
        return routed_tile(b, i, j, *plan_refs)[0], 0, 0

    squeezed = pl.Squeezed()
    in_specs = [
        pl.BlockSpec(memory_space=pl.ANY),  # x stays in HBM; rows are gathered by DMA
        pl.BlockSpec((squeezed, hidden, tf), gate_map),
        pl.BlockSpec((squeezed, hidden, tf), up_map),
        pl.BlockSpec((squeezed, tf, hidden), down_map),
    ]
    operands = [x, w_gate_up, w_gate_up, w_down]
    if quantized:
        gate_up_scale = gate_up_scale.astype(jnp.float32).reshape(num_experts, 1, two_f)
        in_specs += [
            pl.BlockSpec((squeezed, 1, tf), gate_map),
            pl.BlockSpec((squeezed, 1, tf), up_map),
            pl.BlockSpec((squeezed, 1, hidden), down_scale_map),
        ]
        operands += [
            gate_up_scale,
            gate_up_scale,
            down_scale.astype(jnp.float32).reshape(num_experts, 1, hidden),
        ]
    if shared:

        def shared_tile(i, j):  # slot 0 walks the tiles; the other slots keep the last one resident
            return jnp.where(i == 0, jnp.minimum(j, nf_shared - 1), nf_shared - 1)

        in_specs += [
            pl.BlockSpec((hidden, tf_shared), lambda b, i, j, *_: (0, shared_tile(i, j))),
            pl.BlockSpec((hidden, tf_shared), lambda b, i, j, *_: (0, nf_shared + shared_tile(i, j))),
            pl.BlockSpec((tf_shared, hidden), lambda b, i, j, *_: (shared_tile(i, j), 0)),
        ]
        operands += [shared_gate_up, shared_gate_up, shared_down]

    grid = (num_blocks, num_slots_max, max(nf, nf_shared))
    kernel = functools.partial(
        _moe_kernel,
        num_slots_max=num_slots_max,
        nf=nf,
        nf_shared=nf_shared,
        shared=shared,
        quantized=quantized,
        block_tokens=block,
        tile_tokens=tt,
        compute=compute,
        act=act,
    )
    w_bytes = w_gate_up.dtype.itemsize
    vmem = (
        2 * 3 * hidden * max(tf, tf_shared) * w_bytes  # double-buffered gate, up, down tiles
        + block * hidden * (2 * x.dtype.itemsize + 4 + 2 * 4)  # x staging, accumulator, output block
        + tt * (3 * max(tf, tf_shared) + 2 * hidden) * 4  # one tile's f32 intermediates
    )
    rows = num_tokens * experts.shape[1]
    cost = pl.CostEstimate(
        flops=2 * 3 * hidden * (rows * intermediate + num_tokens * shared_f),
        transcendentals=rows * intermediate + num_tokens * shared_f,
        bytes_accessed=int(
            w_gate_up.size * w_bytes
            + w_down.size * w_down.dtype.itemsize  # an upper bound: used experts
            + rows * hidden * x.dtype.itemsize
            + num_tokens * hidden * 4
            + (3 * hidden * shared_f * shared_gate_up.dtype.itemsize if shared else 0)
        ),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, hidden), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(plan),
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block, hidden), lambda b, i, j, *_: (b, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, block, hidden), x.dtype),  # gathered x rows of this slot and the next
                pltpu.VMEM((block, hidden), jnp.float32),  # the slot's rows summed over F tiles
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",) * 3,
            vmem_limit_bytes=int(min(vmem * 1.25 + (4 << 20), 100 << 20)),
        ),
        cost_estimate=cost,
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="fused_moe",
    )(*plan, *operands)
