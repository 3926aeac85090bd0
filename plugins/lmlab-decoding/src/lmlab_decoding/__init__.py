"""Decoding methods for lmlab (entry points ``greedy``, ``sample``, ``beam`` and ``speculative``)."""
