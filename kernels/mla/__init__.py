"""Multi-head latent attention (MLA) over a paged pool of compressed latents: expanded and absorbed forms."""

from kernels.mla.reference import mla_decode_attention, mla_prefill_attention, write_latent

__all__ = ["mla_decode_attention", "mla_prefill_attention", "write_latent"]
