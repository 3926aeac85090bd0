"""Optimizers for lmlab (entry points adamw, sgd, adafactor, lion, lamb, muon, adam8bit)."""
