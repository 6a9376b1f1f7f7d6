"""Multi-head latent attention (DeepSeek-V2/V3, Ling 2.5): low-rank q, a compressed KV latent in the pool."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.mla import mla_decode_attention, mla_prefill_attention, write_latent
from memory import KVPool
from models.batch import ForwardBatch, by_section
from models.config import RopeConfig, yarn_mscale
from models.layers.linear import Linear
from models.layers.norm import RMSNorm
from models.layers.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Shapes of one MLA block. Each cached token is `kv_lora_rank + qk_rope_head_dim` numbers.

    `q_lora_rank` 0 means a plain q projection (DeepSeek-V2-Lite); `rope_interleave` means the checkpoint's
    rope channels are interleaved pairs (HF `apply_rotary_pos_emb_interleave`), which the loader permutes
    into the rotate-half layout, so the model always applies the ordinary RoPE.
    """

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig | None  # None: no positional encoding (Kimi-Linear: the "rope" part stays unrotated)
    rope_interleave: bool = True
    bias: bool = False  # DeepSeek's attention_bias: on q_a, kv_a and o
    rms_norm_eps: float = 1e-6
    head_gate: bool = False  # each head's output times sigmoid(g(x)[head]) before o (Ling 3)

    def __post_init__(self):
        dims = (
            self.num_heads,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        if min(dims) <= 0 or self.q_lora_rank < 0:
            raise ValueError(f"bad MLA shape: {self}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is scaled (as HF)."""
        scale = self.qk_head_dim**-0.5
        if self.rope is not None and self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    def num_params(self, hidden: int) -> int:
        h = self.num_heads
        q = (
            hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
            if self.q_lora_rank
            else hidden * h * self.qk_head_dim
        )
        kv = (
            hidden * self.latent_dim
            + self.kv_lora_rank
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        )
        bias = (self.q_lora_rank + self.latent_dim + hidden) if self.bias else 0
        return q + kv + h * self.v_head_dim * hidden + bias + (hidden * h if self.head_gate else 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig:
        return cls(
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rope=RopeConfig.from_hf(hf),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            bias=bool(hf.get("attention_bias", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        )


class MLAttention(nnx.Module):
    """MLA over a latent KV pool (`KVPool.v` is None): prefill in the expanded form, decode absorbed."""

    def __init__(self, hidden: int, cfg: MLAConfig, *, dtype):
        self.cfg = cfg
        h = cfg.num_heads
        if cfg.q_lora_rank:
            self.q_a = Linear(hidden, cfg.q_lora_rank, bias=cfg.bias, dtype=dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, dtype=dtype)
            self.q_b = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False, dtype=dtype)
            self.q = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q = Linear(hidden, h * cfg.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a = Linear(hidden, cfg.latent_dim, bias=cfg.bias, dtype=dtype)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps, dtype=dtype)
        # HF's kv_b_proj split into its key and value halves, per head.
        self.w_uk = nnx.Param(jnp.zeros((cfg.kv_lora_rank, h, cfg.qk_nope_head_dim), dtype))
        self.w_uv = nnx.Param(jnp.zeros((cfg.kv_lora_rank, h, cfg.v_head_dim), dtype))
        self.o = Linear(h * cfg.v_head_dim, hidden, bias=cfg.bias, dtype=dtype)
        self.g = Linear(hidden, h, bias=False, dtype=dtype) if cfg.head_gate else None

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        """x f[T, hidden] (normed) -> (f32[T, hidden], kv with this step's latents written to layer
        `layer`)."""
        cfg = self.cfg
        t, dtype = x.shape[0], self.o.dtype
        q = self.q_b(self.q_a_norm(self.q_a(x), dtype)) if cfg.q_lora_rank else self.q(x)
        q = q.reshape(t, cfg.num_heads, cfg.qk_head_dim).astype(dtype)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        compressed = self.kv_a(x)  # f32[T, kv_lora_rank + rope]
        c = self.kv_a_norm(compressed[:, : cfg.kv_lora_rank], dtype)
        k_pe = compressed[:, None, cfg.kv_lora_rank :].astype(dtype)  # one rope key shared by all heads
        if cfg.rope is not None:
            inv_freq = cfg.rope.inv_freq(cfg.qk_rope_head_dim)  # a trace-time constant
            q_pe = apply_rope(q_pe, batch.positions, inv_freq, cfg.rope.attention_scaling)
            k_pe = apply_rope(k_pe, batch.positions, inv_freq, cfg.rope.attention_scaling)
        pool = write_latent(kv.k, layer, jnp.concatenate([c, k_pe[:, 0]], axis=-1), batch.out_cache_loc)

        w_uk, w_uv = self.w_uk[...], self.w_uv[...]

        def prefill(q_nope, q_pe, positions):
            return mla_prefill_attention(q_nope, q_pe, pool, layer, batch.prefill_pages, positions, w_uk,
                                         w_uv, page_size=kv.page_size, block_size=batch.prefill_block_size,
                                         scale=cfg.softmax_scale)

        def decode(q_nope, q_pe, positions):
            return mla_decode_attention(q_nope, q_pe, pool, layer, batch.decode_pages, positions, w_uk,
                                        w_uv, page_size=kv.page_size, scale=cfg.softmax_scale)

        attn = by_section(batch, prefill, decode, q_nope, q_pe, batch.positions)  # [T, H, v_head_dim]
        if self.g is not None:
            gate = jax.nn.sigmoid(self.g(x).astype(jnp.float32)).astype(attn.dtype)
            attn = attn * gate[..., None]
        return self.o(attn.reshape(t, cfg.num_heads * cfg.v_head_dim)), KVPool(pool, None, kv.page_size)


def _deinterleave(rows: np.ndarray, rope_dim: int) -> np.ndarray:
    """Reorders the last `rope_dim` rows of each block from pairs (x0 y0 x1 y1 ...) to halves
    (x0 x1 .. y0 y1 ..)."""
    n = rows.shape[-2]
    perm = np.concatenate([np.arange(n - rope_dim), n - rope_dim + np.arange(0, rope_dim, 2),
                           n - rope_dim + np.arange(1, rope_dim, 2)])
    return rows[..., perm, :]


def mla_params_from_hf(
    cfg: MLAConfig, get, prefix: str, *, o_name: str = "o_proj"
) -> dict[tuple[str, ...], np.ndarray]:
    """HF MLA tensors under `prefix` (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, `o_name`) -> our params ({(name, leaf): array}, kernels [in, out]).

    With `rope_interleave` the rope output rows of the q and kv_a projections are de-interleaved here, so
    that q_pe . k_pe is unchanged and the model can use the rotate-half RoPE.
    """
    h, rope = cfg.num_heads, cfg.qk_rope_head_dim

    def q_rows(w):  # [h * qk_head_dim, in] with each head's rope rows last
        if not cfg.rope_interleave:
            return w
        return _deinterleave(w.reshape(h, cfg.qk_head_dim, -1), rope).reshape(h * cfg.qk_head_dim, -1)

    kv_a = get(prefix + "kv_a_proj_with_mqa.weight")  # [kv_lora_rank + rope, hidden]
    if cfg.rope_interleave:
        kv_a = _deinterleave(kv_a, rope)
    kv_b = get(prefix + "kv_b_proj.weight").reshape(
        h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
    )
    out = {
        ("kv_a", "kernel"): kv_a.T,
        ("kv_a_norm", "weight"): get(prefix + "kv_a_layernorm.weight"),
        ("w_uk",): kv_b[:, : cfg.qk_nope_head_dim].transpose(2, 0, 1),
        ("w_uv",): kv_b[:, cfg.qk_nope_head_dim :].transpose(2, 0, 1),
        ("o", "kernel"): get(f"{prefix}{o_name}.weight").T,
    }
    if cfg.q_lora_rank:
        out[("q_a", "kernel")] = get(prefix + "q_a_proj.weight").T
        out[("q_a_norm", "weight")] = get(prefix + "q_a_layernorm.weight")
        out[("q_b", "kernel")] = q_rows(get(prefix + "q_b_proj.weight")).T
    else:
        out[("q", "kernel")] = q_rows(get(prefix + "q_proj.weight")).T
    if cfg.bias:
        if cfg.q_lora_rank:
            out[("q_a", "bias")] = get(prefix + "q_a_proj.bias")
        kv_a_bias = get(prefix + "kv_a_proj_with_mqa.bias")
        out[("kv_a", "bias")] = (
            _deinterleave(kv_a_bias[:, None], rope)[:, 0] if cfg.rope_interleave else kv_a_bias
        )
        out[("o", "bias")] = get(f"{prefix}{o_name}.bias")
    return out
