"""slotserve: a continuous-batching LLM engine and server on MLX."""

from slotserve.blas import load_openblas

load_openblas()
