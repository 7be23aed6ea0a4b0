"""Point-in-time copies of tensors for async saves, into buffers reused across saves.

An async save must copy the state before training changes it. Reusing the previous save's
buffers (matched by position, shape and dtype) turns the copy into a plain memcpy into memory
that is already mapped, instead of fresh allocations that page-fault on first touch. CUDA
tensors go into pinned host buffers with non-blocking copies.

**Overlapped snapshots.** Parameters and optimizer state do not change between one
``optimizer.step()`` and the next, so their copy need not block the caller: it can run while
the next forward and backward run, and only the next update must wait for it (DataStates-LLM).
With a ``deferred`` predicate, ``begin`` copies at once only the tensors it rejects (a
BatchNorm buffer changes during forward) and queues the rest as a :class:`BackgroundCopy`:

- CPU tensors are copied in pieces of :data:`PIECE_BYTES` by the save's worker thread; a thread
  that must update the state first (:meth:`BackgroundCopy.wait`, from an optimizer pre-hook)
  takes the pieces still queued and copies them itself, so it waits only for what is left.
- CUDA tensors are copied at once, on a side stream that first waits for the compute stream, so
  the device-to-host transfers overlap the next forward and backward. Waiting before an update
  costs the host nothing: the compute stream waits for the copy's event, and only the writer,
  which reads the host buffers, waits on the host.

Reuse is safe because only one save is in flight per store: the next snapshot starts only
after the previous save has finished reading its buffers.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckptstore.errors import ConfigError

PIECE_BYTES = 8 << 20
"""Granularity of a background CPU copy: small enough for the updating thread to share the
work left, large enough that the queue costs nothing."""
Piece = tuple[torch.Tensor, torch.Tensor, int, int]
"""``(buffer, source, start, end)``: elements of one tensor to copy, see :func:`copy_piece`."""


class Snapshotter:
    """Callable that copies (or queues the copy of) one tensor into its reusable buffer,
    between ``begin`` and ``finish``."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._cuda_devices: set[torch.device] = set()
        self._deferred: Callable[[torch.Tensor], bool] | None = None
        self._pieces: list[Piece] = []
        self._streams: dict[torch.device, Any] = {}
        """A side stream per device, kept from save to save."""
        self._side_devices: set[torch.device] = set()
        """Devices whose side stream copies for the snapshot being taken."""

    def begin(self, deferred: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Start a snapshot; tensors for which ``deferred`` says True are copied later."""
        self._next = 0
        self._cuda_devices = set()
        self._deferred = deferred
        self._pieces = []
        self._side_devices = set()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffer_for(source)
        if self._deferred is not None and self._deferred(source):
            self._defer(source, buffer)
        else:
            buffer.copy_(source, non_blocking=source.is_cuda)
            if source.is_cuda:
                self._cuda_devices.add(source.device)
        return buffer

    def finish(self) -> BackgroundCopy:
        """Drop buffers the state no longer has; the copies still to make. Without deferral
        this waits for device copies, so the result is already done."""
        del self._buffers[self._next :]
        events = []
        if self._cuda_devices and self._deferred is None:
            torch.cuda.synchronize()
        elif self._cuda_devices:  # immediate copies ran on the compute streams: mark their end
            events += [_recorded(d, torch.cuda.current_stream(d)) for d in self._cuda_devices]
        events += [_recorded(d, self._streams[d]) for d in self._side_devices]
        pieces, self._pieces = self._pieces, []
        return BackgroundCopy(pieces, events)

    def _buffer_for(self, source: torch.Tensor) -> torch.Tensor:
        index, self._next = self._next, self._next + 1
        if index < len(self._buffers) and _fits(self._buffers[index], source):
            return self._buffers[index]
        buffer = torch.empty(
            source.shape,
            dtype=source.dtype,
            pin_memory=source.is_cuda and torch.cuda.is_available(),
        )
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    def _defer(self, source: torch.Tensor, buffer: torch.Tensor) -> None:
        if source.is_cuda:
            device = source.device
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stream = self._streams[device]
            if device not in self._side_devices:  # copy what the compute stream has computed
                stream.wait_stream(torch.cuda.current_stream(device))
                self._side_devices.add(device)
            with torch.cuda.stream(stream):
                buffer.copy_(source, non_blocking=True)
            source.record_stream(stream)  # its memory stays allocated until the copy ran
            return
        count = source.numel()
        step = max(1, PIECE_BYTES // source.element_size())
        if count <= step or not source.is_contiguous():
            self._pieces.append((buffer, source, 0, count))  # most tensors: one piece
            return
        self._pieces += [(buffer, source, a, min(a + step, count)) for a in range(0, count, step)]


class BackgroundCopy:
    """Copies queued by an overlapped snapshot. The worker runs them (:meth:`run`); a thread
    about to change the state calls :meth:`wait`, which copies what is still queued alongside
    the worker and returns when every piece is in its buffer. ``wait`` never raises: a piece
    that failed fails the save, in ``run``."""

    def __init__(
        self, pieces: list[Piece], events: Iterable[tuple[torch.device, Any]] = ()
    ) -> None:
        self._pieces = pieces
        self._events = list(events)
        self._next = 0
        self._busy = 0
        self._error: BaseException | None = None
        self._lock = threading.Condition()
        self._device_waited = False
        self.waited_seconds = 0.0
        """How long threads other than the worker waited for the copy, in all."""

    @property
    def done(self) -> bool:
        with self._lock:
            return self._next >= len(self._pieces) and not self._busy

    def run(self) -> None:
        """Copy every piece (in the save's worker), then wait for device copies; let go of
        the sources once done."""
        self._copy_all()
        for _, event in self._events:
            event.synchronize()
        with self._lock:
            self._pieces, self._next = [], 0
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Return once nothing the copy reads may still change (before an update)."""
        started = time.perf_counter()
        self._copy_all()
        if self._events and not self._device_waited:
            for device, event in self._events:  # the compute stream waits; the host does not
                torch.cuda.current_stream(device).wait_event(event)
            self._device_waited = True
        with self._lock:
            self.waited_seconds += time.perf_counter() - started

    def _copy_all(self) -> None:
        while (piece := self._take()) is not None:
            try:
                copy_piece(*piece)
            except BaseException as e:
                with self._lock:
                    self._error = self._error or e
            finally:
                with self._lock:
                    self._busy -= 1
                    self._lock.notify_all()
        with self._lock:
            self._lock.wait_for(lambda: not self._busy)

    def _take(self) -> Piece | None:
        with self._lock:
            if self._next >= len(self._pieces) or self._error is not None:
                self._next = len(self._pieces)
                return None
            self._next += 1
            self._busy += 1
            return self._pieces[self._next - 1]


class UpdateGuard:
    """Makes the state's next update wait for the pending overlapped copy: a step pre-hook on
    each optimizer a save named (kept until ``close``, so nothing is removed while an
    optimizer iterates its hooks), and :meth:`before_update` for other updates."""

    def __init__(self) -> None:
        self._copy: BackgroundCopy | None = None
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def watch(self, copy: BackgroundCopy, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._copy = copy
        for optimizer in optimizers:
            if optimizer not in self._hooks:
                self._hooks[optimizer] = optimizer.register_step_pre_hook(self._pre_hook)
        if copy.done:
            self._copy = None

    def before_update(self) -> None:
        copy = self._copy
        if copy is not None:
            copy.wait()

    def close(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()
        self._copy = None

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.before_update()


def deferral(overlap: object) -> tuple[Callable[[torch.Tensor], bool] | None, list[Any]]:
    """What an overlapped save defers, and the optimizers whose steps wait for it: for
    ``True``, every tensor (the caller calls ``before_update``); for optimizers, their
    parameters and state; for ``False``, nothing."""
    if overlap is False:
        return None, []
    if overlap is True:
        return (lambda tensor: tensor.numel() > 0), []
    optimizers = [overlap] if isinstance(overlap, torch.optim.Optimizer) else overlap
    try:
        optimizers = list(optimizers)  # type: ignore[call-overload]
    except TypeError:
        optimizers = None
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ConfigError(
            f"overlap must be True, False, a torch.optim.Optimizer or a list of them, got "
            f"{overlap!r}. Pass the optimizer whose step() changes the saved tensors"
        )
    return in_storages(storages_of(optimizers)), optimizers


def storages_of(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple[torch.device, int]]:
    """Where the parameters and state of ``optimizers`` live: the tensors that only their
    ``step()`` changes. ``state_dict()`` tensors are views of them, found by storage."""
    found: set[tuple[torch.device, int]] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            found.update(_storage(p) for p in group["params"])
        for state in optimizer.state.values():
            found.update(_storage(v) for v in state.values() if isinstance(v, torch.Tensor))
    return found


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def in_storages(storages: set[tuple[torch.device, int]]) -> Callable[[torch.Tensor], bool]:
    """The ``deferred`` predicate for tensors living in ``storages``."""
    return lambda tensor: tensor.numel() > 0 and _storage(tensor) in storages


def copy_piece(buffer: torch.Tensor, source: torch.Tensor, start: int, end: int) -> None:
    """Copy elements ``[start, end)`` of ``source`` (contiguous unless whole) into ``buffer``;
    views are made here, in the copying thread, not in the caller."""
    if start == 0 and end == source.numel():
        buffer.copy_(source)
    else:
        buffer.view(-1)[start:end].copy_(source.view(-1)[start:end])


def _recorded(device: torch.device, stream: Any) -> tuple[torch.device, Any]:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return device, event


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.shape == source.shape and buffer.dtype == source.dtype
