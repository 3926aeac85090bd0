"""The angles both sinusoidal schemes share: position × base^(-2i/d) for each pair i of d dimensions."""

import torch


def angles(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """positions (T,) or (B, T) → (T, ceil(dim / 2)) or (B, T, ceil(dim / 2)) float32 angles.

    Computed in float32 from scratch even when the model runs in half precision: position × frequency
    loses whole radians in bfloat16 at positions of a few hundred. The frequencies are written as
    Hugging Face's Llama writes them, so rotary embeddings match it bit for bit.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    return positions[..., None].float() * inv_freq
