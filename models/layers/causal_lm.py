"""What every decoder has around its layers: the token embedding, the final RMSNorm and the LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.linear import QuantizedWeight, lm_logits
from models.layers.norm import RMSNorm


class CausalLM(nnx.Module):
    """Base of the model classes: `init_ends` builds `embed` f[vocab, hidden], `norm` and `lm_head`
    f[hidden, vocab] (None when tied to the embedding); subclasses add their layers and `__call__`."""

    def init_ends(self, cfg, norm_eps: float, *, dtype) -> None:
        """`cfg` has vocab_size, hidden_size and tie_word_embeddings."""
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.norm = RMSNorm(cfg.hidden_size, eps=norm_eps, dtype=dtype)
        untied = not cfg.tie_word_embeddings
        self.lm_head = nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype)) if untied else None
        # Quantized (models/quantization.py `quantize_linears`): `embed` (and `lm_head`, then stored
        # [vocab, hidden]) hold the grouped 4-/8-bit values, these their scales and minimums.
        self.embed_scale = self.embed_zero = self.lm_head_scale = self.lm_head_zero = None
        self.activations = "none"  # how a quantized LM head's inputs are rounded (`quantize_linears` sets it)
        # the quantized embedding's and LM head's layouts (models/quantization.py `to_stored_panels`)
        self.embed_layout = self.lm_head_layout = "rows"

    def embed_weight(self) -> jax.Array | QuantizedWeight:
        if self.embed_scale is None:
            return self.embed[...]
        return QuantizedWeight.of(self.embed, self.embed_scale, self.embed_zero, self.activations,
                                  self.embed_layout)

    def lm_head_weight(self) -> jax.Array | QuantizedWeight | None:
        """The untied LM head (None when tied to the embedding)."""
        if self.lm_head is None or self.lm_head_scale is None:
            return None if self.lm_head is None else self.lm_head[...]
        return QuantizedWeight.of(self.lm_head, self.lm_head_scale, self.lm_head_zero, self.activations,
                                  self.lm_head_layout)

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        """f32[T, hidden] rows of the tokens: the residual stream stays float32 whatever the dtype."""
        embed = self.embed_weight()
        if isinstance(embed, QuantizedWeight):
            return embed.rows(input_ids)
        return embed[input_ids].astype(jnp.float32)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden]."""
        return lm_logits(hidden, self.embed_weight(), self.lm_head_weight())
