"""Feed-forward plugins for lmlab: mlp, swiglu. Loaded through entry points, never by import."""
