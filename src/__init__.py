"""slotserve: a continuous-batching LLM engine and server on MLX."""

from slotserve.runtime.blas import load_openblas

load_openblas()
