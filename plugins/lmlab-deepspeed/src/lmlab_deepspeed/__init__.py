"""DeepSpeed ZeRO for lmlab: optimizer state, gradients and parameters sharded over data-parallel ranks."""
