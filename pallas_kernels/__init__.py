"""Pallas paged-attention kernels (GPU via Triton) and their pure-jnp references.

On GPUs the model calls the Pallas entries; on CPU it calls the ``*_reference``
functions (pure jnp, the CPU serving path). Both accept ``layer=`` to read or
write one layer of a cache stacked over layers.
"""

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.paged_attention_decode import (
    paged_attention_decode,
    paged_attention_decode_reference,
)
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.write_kv import write_kv, write_kv_reference

__all__ = [
    "grouped_matmul",
    "grouped_matmul_reference",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
