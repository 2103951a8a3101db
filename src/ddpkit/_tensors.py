"""A tensor's bytes without numpy (which an image with CUDA torch alone, ``make gpu-check``'s, may lack).

A base module (it imports nothing of ddpkit).

Example:
    >>> raw_bytes(torch.tensor([1, 2], dtype=torch.uint8))
    b'\\x01\\x02'
"""

from __future__ import annotations

import ctypes

import torch


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``'s elements in order, on the host (what ``tensor.numpy().tobytes()`` gives).

    One copy in C of a contiguous host copy's memory. ``bytes(storage)`` would give the same bytes,
    but it reads them one element at a time in Python: 115 s for ResNet-18's 45 MB of weights, which
    the bench digests once a run."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not flat.numel():
        return b""
    # `flat` stays referenced for the read: its memory is alive and holds exactly these bytes
    return ctypes.string_at(flat.data_ptr(), flat.numel())


__all__ = ["raw_bytes"]
