"""Weight conversion between lmlab models and other libraries' checkpoints."""
