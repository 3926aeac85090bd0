"""Training objectives for lmlab (entry points ``causal-lm``, ``sft``, ``mlm``)."""
