"""Data sources for lmlab (entry point ``text-file``)."""
