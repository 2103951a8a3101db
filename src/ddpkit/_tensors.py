"""A tensor's bytes without numpy (which an image with CUDA torch alone, ``make gpu-check``'s, may lack).

A base module (it imports nothing of ddpkit).

Example:
    >>> raw_bytes(torch.tensor([1, 2], dtype=torch.uint8))
    b'\\x01\\x02'
"""

from __future__ import annotations

import torch


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``'s elements in order, on the host (what ``tensor.numpy().tobytes()`` gives)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not flat.numel():
        return b""
    own = flat.clone()  # a storage of exactly these bytes (a view's storage may hold more)
    return bytes(own.untyped_storage())


__all__ = ["raw_bytes"]
