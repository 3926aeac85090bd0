"""The angles both sinusoidal schemes share: position × base^(-2i/d) for each pair i of d dimensions."""

import torch


def frequencies(dim: int, base: float, device=None) -> torch.Tensor:
    """base^(-2i/dim) for each pair i of ``dim`` dimensions, float32, written as Hugging Face's Llama
    writes them, so rotary embeddings match it bit for bit."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


def angles(positions: torch.Tensor, dim: int, base: float, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """positions (T,) or (B, T) → (T, ceil(dim / 2)) or (B, T, ceil(dim / 2)) float32 angles
    (``inv_freq``: the frequencies to use instead of :func:`frequencies`'s).

    Computed in float32 from scratch even when the model runs in half precision: position × frequency
    loses whole radians in bfloat16 at positions of a few hundred.
    """
    if inv_freq is None:
        inv_freq = frequencies(dim, base, positions.device)
    return positions[..., None].float() * inv_freq.to(positions.device)
