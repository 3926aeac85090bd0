"""Mamba (Gu & Dao 2023): a selective state-space mixer for lmlab's attention slot."""
