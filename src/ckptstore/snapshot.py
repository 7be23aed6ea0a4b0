"""Point-in-time copies of tensors for async saves, into buffers reused across saves.

An async save must copy the state before training changes it; that copy is the only part the
trainer waits for. Reusing the previous save's buffers (matched by position, shape and dtype)
turns the copy into a plain memcpy into memory that is already mapped, instead of fresh
allocations that page-fault on first touch. CUDA tensors go into pinned host buffers with
non-blocking copies and one synchronize at the end, so the device-to-host transfers overlap.

Reuse is safe because only one save is in flight per store: the next snapshot starts only
after the previous save has finished reading its buffers.
"""

from __future__ import annotations

import torch


class Snapshotter:
    """Callable that copies one tensor into its reusable buffer; ``begin``/``finish`` a save."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._cuda_pending = False

    def begin(self) -> None:
        self._next = 0
        self._cuda_pending = False

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        index, self._next = self._next, self._next + 1
        if index < len(self._buffers) and _fits(self._buffers[index], source):
            buffer = self._buffers[index]
        else:
            buffer = torch.empty(
                source.shape,
                dtype=source.dtype,
                pin_memory=source.is_cuda and torch.cuda.is_available(),
            )
            if index < len(self._buffers):
                self._buffers[index] = buffer
            else:
                self._buffers.append(buffer)
        buffer.copy_(source, non_blocking=source.is_cuda)
        self._cuda_pending |= source.is_cuda
        return buffer

    def finish(self) -> None:
        """Wait for device copies; drop buffers the state no longer has."""
        if self._cuda_pending:
            torch.cuda.synchronize()
        del self._buffers[self._next :]


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.shape == source.shape and buffer.dtype == source.dtype
