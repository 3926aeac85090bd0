"""Character- and byte-level tokenizers for lmlab (entry points ``char`` and ``byte``)."""
