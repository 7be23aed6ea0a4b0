"""Chunks that carry their CRC32C: one pass over a file's bytes serves two checksums.

A save checksums every file for its manifest as the bytes stream to the backend, and S3 wants
the same CRC32C in the header of the request that carries them (``ChecksumCRC32C``), which the
server checks against what it received. Where one request carries a whole file (a single
PutObject), the two are the same number: :class:`Crc32cChunks` computes it as the chunks pass,
and a backend that sent every chunk in one request takes :attr:`Crc32cChunks.value` instead of
reading the bytes a second time. A backend that does not look at it loses nothing. The same
count also tells a save whether the file equals the previous step's (commit.py's
``_UnlessSame``), where the backend holds it whole before sending (``sends_whole_up_to``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import crc32c

from ckptstore.backends.base import Chunk, chunk_size


class Crc32cChunks(Iterator[Chunk]):
    """``chunks`` passed through, their CRC32C and size counted on the way; ``done`` once the
    last was taken, when ``value`` is the CRC32C of every byte."""

    def __init__(self, chunks: Iterable[Chunk], *, stable: bool = False) -> None:
        self._chunks = iter(chunks)
        self.stable = stable
        """Every chunk stays valid and unchanged until the write returns (a save's views of
        its tensors): a backend may send them where they lie instead of copying them."""
        self.value = 0
        self.size = 0
        self.done = False

    def __iter__(self) -> Crc32cChunks:
        return self

    def __next__(self) -> Chunk:
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self.done = True
            raise
        self.value = crc32c.crc32c(chunk, self.value)
        self.size += chunk_size(chunk)
        return chunk

    def whole(self, size: int) -> int | None:
        """The CRC32C of the whole file, if every chunk was taken and they held ``size``
        bytes (the object a backend sent), else ``None``."""
        return self.value if self.done and self.size == size else None
