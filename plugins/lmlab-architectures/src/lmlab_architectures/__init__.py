"""Architectures for lmlab: how the position, attention and ffn plugins are wired into a model."""
