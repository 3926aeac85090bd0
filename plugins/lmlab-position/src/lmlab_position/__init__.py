"""Position plugins for lmlab: learned, rope, sinusoidal, alibi, none. Loaded through entry points, never by import."""
