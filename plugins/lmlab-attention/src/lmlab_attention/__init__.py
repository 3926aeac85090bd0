"""Softmax attention plugins for lmlab: mha, gqa, mqa. Loaded through entry points, never by import."""
