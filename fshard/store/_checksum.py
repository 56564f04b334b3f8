"""Per-item checksums, computed on put and verified on every read.

`fast` (default) is a Fletcher-style sum over 4 KiB blocks: each block is summed as uint64 words (numpy, one
memory pass, ~18 GB/s on the dev box), then the block sums are combined with position weights, so a stale,
zeroed, shifted or misplaced block changes the result. It is not cryptographic and misses word swaps inside one
block; `crc32` (zlib, ~2.7 GB/s, releases the GIL) is available when that matters. crc32 at 2.7 GB/s would cost
more than the I/O itself on the write path (page cache writes run at 7-8 GB/s), which is why it is not the default.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch
from ..errors import ArgumentError

_BLOCK_WORDS = 512  # 4 KiB of uint64 words
_MASK = (1 << 64) - 1


def _fast(a: np.ndarray) -> int:
    n = a.size
    nwords = n // 8
    nblocks = nwords // _BLOCK_WORDS
    s1 = s2 = 0
    if nblocks:
        words = a[: nblocks * _BLOCK_WORDS * 8].view(np.uint64).reshape(nblocks, _BLOCK_WORDS)
        sums = np.add.reduce(words, axis=1, dtype=np.uint64)  # wraps mod 2**64, no overflow error
        weights = np.arange(1, nblocks + 1, dtype=np.uint64)
        s1 = int(np.add.reduce(sums, dtype=np.uint64))
        s2 = int(np.add.reduce(sums * weights, dtype=np.uint64))
    rest = a[nblocks * _BLOCK_WORDS * 8:]
    if rest.size:  # the tail (< 4 KiB): pad to whole words, weight it as the last block
        padded = np.zeros((rest.size + 7) // 8 * 8, dtype=np.uint8)
        padded[: rest.size] = rest
        t = int(np.add.reduce(padded.view(np.uint64), dtype=np.uint64))
        s1 = (s1 + t) & _MASK
        s2 = (s2 + t * (nblocks + 1)) & _MASK
    # Fold in the length so a truncated copy of a zero-tailed item still differs.
    return (s2 << 64 | s1) ^ (n * 0x9E3779B97F4A7C15)


def checksum(u8: torch.Tensor, kind: str = "fast") -> int:
    """Checksum of a contiguous uint8 CPU tensor."""
    a = u8.numpy() if u8.numel() else np.empty(0, dtype=np.uint8)
    if kind == "fast":
        return _fast(a)
    if kind == "crc32":
        return zlib.crc32(a)
    raise ArgumentError(f"unknown checksum kind {kind!r}; use 'fast' or 'crc32'")


def validate_kind(kind: str) -> str:
    if kind not in ("fast", "crc32"):
        raise ArgumentError(f"unknown checksum kind {kind!r}; use 'fast' or 'crc32'")
    return kind
