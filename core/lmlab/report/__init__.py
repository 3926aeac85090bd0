"""``lmlab compare``'s pieces: reading runs (folders or W&B), statistics over seeds, table and plots."""
