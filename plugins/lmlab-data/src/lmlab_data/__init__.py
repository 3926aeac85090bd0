"""Data sources for lmlab (entry points ``text-file``, ``jsonl`` and ``alpaca``)."""
