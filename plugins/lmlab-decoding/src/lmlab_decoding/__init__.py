"""Decoding methods for lmlab (entry points ``greedy`` and ``sample``)."""
