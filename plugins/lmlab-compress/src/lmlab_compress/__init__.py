"""Compression methods for lmlab (the ``compress`` slot): quantisation, sparsity and head pruning."""
