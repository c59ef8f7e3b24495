"""A deterministic memory probe: the largest tensor any torch operation returns inside a block."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LargestTensor"]


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) that an aten op returns while the mode is active.

    ``with LargestTensor() as probe: ...`` then ``probe.largest`` (elements), ``probe.shape`` and
    ``probe.op`` (the op that returned it). Unlike a peak-RSS reading it does not depend on the
    allocator or on other threads, so a check can assert that no ``n x n`` (or ``n x M`` above the
    memory budget) tensor was ever formed, in the forward and the backward pass alike (the autograd
    engine runs CPU backward ops in the calling thread, inside the mode).
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.shape, self.op = 0, (), None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.largest:
                self.largest, self.shape, self.op = tensor.numel(), tuple(tensor.shape), str(func)
        return out
