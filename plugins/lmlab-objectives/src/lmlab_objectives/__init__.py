"""Training objectives for lmlab (entry point ``causal-lm``)."""
