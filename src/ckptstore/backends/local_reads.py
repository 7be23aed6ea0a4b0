"""A local file read into memory the caller owns: from the page cache where it holds the bytes,
straight from the disk where it does not.

A file a resume reads is usually cold: the node was replaced or rebooted, or its page cache has
since filled with other data. A buffered read of a cold file costs the CPU twice: the kernel
reads the disk into page-cache pages it has to find, map and account for, then copies them
into the caller's buffer. On a 2-core machine that was most of a local load's CPU (0.15 s of
system time per 256 MiB, against 0.08 s for the same bytes read with ``O_DIRECT``), and with
other work on those cores the reads waited for it. So a piece the page cache does not hold is
read with ``O_DIRECT``, by DMA into the caller's buffer (a load's: the tensors' own memory),
with no copy in between; a piece it does hold (a file this node wrote or read a moment ago) is
copied from the cache, where ``O_DIRECT`` would read the disk again.

Which of the two a piece is, a ``RWF_NOWAIT`` read of its first page says: it returns the page
from the cache, or ``EAGAIN`` instead of waiting for the disk. The descriptor it uses is
advised ``POSIX_FADV_RANDOM``, so that a miss reads that one page ahead and not a whole
read-ahead window the direct read would then read again.

``O_DIRECT`` needs the buffer's address, the offset and the length aligned to the device's
logical block (:data:`ALIGN` covers every common one): a file's aligned front is read direct,
its last partial block through the cache. Where any of this does not hold (a buffer that is
not page-aligned, a file under :data:`DIRECT_MIN`, a filesystem that refuses ``O_DIRECT`` or
``RWF_NOWAIT``, such as NFS, FUSE or older tmpfs, or a platform without them), the file is
read through the cache as before: the same bytes, in the same pieces, handed over in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable
from pathlib import Path

ALIGN = 4096
"""Alignment of a direct read's address, offset and length: the page size, a multiple of
every common logical block size (512 or 4096 bytes)."""
DIRECT_MIN = 1 << 20
"""Files smaller than this are read through the cache: one request either way, and a small
file is as likely to be cached as not."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
"""What a filesystem or kernel that does not do ``O_DIRECT`` or ``RWF_NOWAIT`` answers."""


def read_pieces(
    target: Path,
    out: memoryview,
    piece_size: int,
    on_chunk: Callable[[memoryview], None],
    before_piece: Callable[[int], None],
) -> int:
    """Fill ``out`` from the start of ``target`` in pieces of at most ``piece_size`` bytes,
    each handed to ``on_chunk`` once filled, in order; ``before_piece(bytes so far)`` runs
    before each. Stops early at the end of the file; returns the file's size."""
    fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    try:
        direct = _DirectReads.open(target, fd, out)
        if direct is None:
            _advise(fd, "POSIX_FADV_SEQUENTIAL")  # a wider read-ahead for the cold pieces
        try:
            filled = 0
            while filled < len(out):
                before_piece(filled)
                end = min(len(out), filled + piece_size)
                n = direct.read(out, filled, end) if direct is not None else None
                if n is None:  # cached, the tail, or not direct here: through the cache
                    n = os.preadv(fd, [out[filled:end]], filled)  # releases the GIL
                if not n:
                    break
                on_chunk(out[filled : filled + n])
                filled += n
        finally:
            if direct is not None:
                direct.close()
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


class _DirectReads:
    """One file's direct reads, and the page-cache probe that decides each piece."""

    def __init__(self, fd: int, probe_fd: int, aligned_end: int) -> None:
        self.fd, self.probe_fd, self.aligned_end = fd, probe_fd, aligned_end
        self.page = bytearray(ALIGN)
        self.on = True

    @classmethod
    def open(cls, target: Path, fd: int, out: memoryview) -> _DirectReads | None:
        """Direct reads of ``target`` into ``out``, or None where they cannot be made."""
        if not (_O_DIRECT and _RWF_NOWAIT) or len(out) < DIRECT_MIN or not _aligned(out):
            return None
        try:
            direct = os.open(target, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
        except OSError as e:
            if e.errno in _REFUSED:
                return None
            raise
        _advise(fd, "POSIX_FADV_RANDOM")  # the probe's miss reads one page, not a window
        return cls(direct, fd, len(out) // ALIGN * ALIGN)

    def read(self, out: memoryview, start: int, end: int) -> int | None:
        """Bytes read direct into ``out[start:end]`` (its aligned front), or None where the
        piece is to be read through the cache."""
        end = min(end, self.aligned_end) // ALIGN * ALIGN
        if not self.on or start % ALIGN or end <= start or self._cached(start):
            return None
        try:
            n = os.preadv(self.fd, [out[start:end]], start)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self._stop()
            return None
        if n < end - start:  # the file ended early: what is left of it, through the cache
            self._stop()
        return n

    def _cached(self, start: int) -> bool:
        """Whether the page cache holds the page at ``start`` (a read that cannot wait)."""
        try:
            return os.preadv(self.probe_fd, [self.page], start, _RWF_NOWAIT) >= 0
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self._stop()
            return True

    def _stop(self) -> None:
        """The rest of the file through the cache, read ahead as before."""
        self.on = False
        _advise(self.probe_fd, "POSIX_FADV_SEQUENTIAL")

    def close(self) -> None:
        os.close(self.fd)


def _aligned(out: memoryview) -> bool:
    """Whether ``out`` starts on an :data:`ALIGN` boundary (mmap'd buffers do)."""
    if out.readonly or not out.contiguous:
        return False
    anchor = ctypes.c_char.from_buffer(out)
    try:
        return ctypes.addressof(anchor) % ALIGN == 0
    finally:
        del anchor


def _advise(fd: int, advice: str) -> None:
    """A read-ahead hint: a filesystem or platform without it reads the same bytes."""
    advise, value = getattr(os, "posix_fadvise", None), getattr(os, advice, None)
    if advise is not None and value is not None:
        with contextlib.suppress(OSError):
            advise(fd, 0, 0, value)
