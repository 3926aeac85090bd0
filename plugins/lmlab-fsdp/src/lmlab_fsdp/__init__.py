"""Fully sharded data parallel (FSDP2) for lmlab: parameters, gradients and optimizer state sharded across processes."""
