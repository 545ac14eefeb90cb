"""Pallas paged-attention kernels (GPU via Triton) and their pure-jnp references."""
