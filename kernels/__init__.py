"""Device ops: one package per op, each with a plain-jnp reference and (where written) a Pallas kernel."""
