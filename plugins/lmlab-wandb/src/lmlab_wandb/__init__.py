"""The Weights & Biases tracker plugin for lmlab."""
