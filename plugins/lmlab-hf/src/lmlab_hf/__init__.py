"""Hugging Face tokenizers for lmlab (entry point ``hf``)."""
