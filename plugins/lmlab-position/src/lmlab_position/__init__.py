"""Position plugins for lmlab: learned, rope. Loaded through entry points, never by import."""
