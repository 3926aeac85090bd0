"""Bit packing of small unsigned integers into bytes, so that a 4-bit or 3-bit weight really takes 4 or
3 bits in the state dict (the point of quantising on a CPU, where no kernel reads a custom format).

Values are packed along the last dimension, in chunks of ``k`` values that fill ``m`` whole bytes
(``k * bits = 8 * m``): 2 values in 1 byte at 4 bits, 8 values in 3 bytes at 3 bits, 4 in 1 at 2.
Within a chunk value ``i`` takes bits ``[i * bits, (i + 1) * bits)`` of a little-endian word, so at 4
bits the first value is the low nibble. A row whose length is not a multiple of ``k`` is padded
with zeros, which :func:`unpack` drops again.
"""

import math

import torch


def chunk(bits: int) -> tuple[int, int]:
    """(values, bytes) of one packed chunk at ``bits`` bits per value."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    values = 8 // math.gcd(8, bits)
    return values, values * bits // 8


def packed_length(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits take (the last chunk padded)."""
    values, size = chunk(bits)
    return -(-n // values) * size


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in ``[0, 2**bits)`` (any integer dtype, shape (..., n)) → uint8 (..., packed_length(n))."""
    k, m = chunk(bits)
    n = values.shape[-1]
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack in {bits} bits")
    pad = -n % k
    v = torch.nn.functional.pad(values.to(torch.int64), (0, pad)).unflatten(-1, (-1, k))
    # One word per chunk (at most 56 bits: an int64 holds it), then its bytes, low byte first.
    word = (v << (torch.arange(k, device=v.device) * bits)).sum(-1, keepdim=True)
    out = (word >> (torch.arange(m, device=v.device) * 8)) & 0xFF
    return out.to(torch.uint8).flatten(-2)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of :func:`pack`: uint8 (..., packed_length(n)) → uint8 values (..., n)."""
    if bits == 4:  # the hot path of every 4-bit forward: two nibbles per byte, low first
        return torch.stack((packed & 0x0F, packed >> 4), -1).flatten(-2)[..., :n]
    if bits == 8:
        return packed[..., :n]
    k, m = chunk(bits)
    wide = torch.int32 if bits * k <= 31 else torch.int64
    b = packed.unflatten(-1, (-1, m)).to(wide)
    word = (b << (torch.arange(m, device=b.device, dtype=wide) * 8)).sum(-1, keepdim=True, dtype=wide)
    v = (word >> (torch.arange(k, device=b.device, dtype=wide) * bits)) & ((1 << bits) - 1)
    return v.to(torch.uint8).flatten(-2)[..., :n]


def unpack_float(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack` as float32 values: the first step of every dequantisation. At 4 bits each
    nibble is written straight into its float slot (the conversion fused with the interleaving),
    which took about half the time of unpacking to bytes and converting on this project's CPU."""
    if bits != 4 or n % 2:
        return unpack(packed, bits, n).float()
    out = torch.empty(*packed.shape, 2, device=packed.device)
    out[..., 0] = packed & 0x0F
    out[..., 1] = packed >> 4
    return out.flatten(-2)
