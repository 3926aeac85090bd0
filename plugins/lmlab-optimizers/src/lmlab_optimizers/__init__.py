"""Optimizers for lmlab (entry point ``adamw``)."""
