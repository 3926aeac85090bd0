"""Data orders for lmlab (the ``order`` slot): which training documents each step draws from."""
