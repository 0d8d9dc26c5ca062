"""jflash: FlashAttention for JAX.

Exact attention computed tile by tile with an online softmax (CUDA kernels on
NVIDIA GPUs from sm80 on, a C++ twin of the same algorithm on CPU), registered
as XLA FFI custom calls, differentiable through jax.custom_vjp.
"""

from jflash import context_parallel, reference
from jflash._src.context_parallel import context_parallel_strategy, sequence_layout
from jflash._src.decode import flash_attention_with_kvcache
from jflash._src.dot_product_attention import dot_product_attention
from jflash._src.ffi import HAS_CUDA_KERNELS
from jflash._src.flash_attention import LSE_NAME, OUT_NAME, flash_attention
from jflash._src.varlen import flash_attention_varlen

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "dot_product_attention",
    "reference",
    "context_parallel",
    "context_parallel_strategy",
    "sequence_layout",
    "HAS_CUDA_KERNELS",
    "OUT_NAME",
    "LSE_NAME",
]
__version__ = "0.1.0"
