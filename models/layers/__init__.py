"""Building blocks the model families assemble: projections, norms, MLPs, attention, MLA, MoE, SSM mixers."""
