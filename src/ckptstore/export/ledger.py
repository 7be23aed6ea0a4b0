"""Checking a file that was read in ranges, out of order, against its one CRC32C.

A step's manifest holds one CRC32C per file, computed over the bytes in order. An export reads
rank files piece by piece (a tensor's rows here, an archive's directory there) in the order the
output needs, never the file's. CRC32C is linear, so the CRCs of consecutive ranges combine
into the CRC of their concatenation (zlib's ``crc32_combine``, for the Castagnoli polynomial):
every read records ``(start, end, crc)`` in a :class:`Ledger`, and :meth:`Ledger.finish` reads
what no piece covered (zip headers between records, items the export skipped), combines the
pieces in file order and compares the result with the manifest. So every byte of every file
an export used is checked, and the file is read about once, not once to check and once to use.

Ranges read twice must agree: identical ranges by their CRCs; ranges that overlap otherwise
(an archive's directory read by torch, then by a neighbouring piece) are read once more as one
span, whose bytes then check each of them. A file whose pieces were read from a changing
object therefore fails, as it would on a whole-file load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c

from ckptstore.errors import CorruptCheckpointError

_POLY = 0x82F63B78
"""CRC-32C (Castagnoli), reflected."""


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (both reflected, as zlib's ``multmodp``)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k = 0..63 (byte counts up to 2^60)."""
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``A + B`` from ``crc1 = crc(A)``, ``crc2 = crc(B)`` and ``len(B)``."""
    power = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2): 2^3 bits per byte
    while n:
        if n & 1:
            power = _multmodp(_X2N[k], power)
        n >>= 1
        k += 1
    return _multmodp(power, crc1) ^ crc2


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of a file, read once, and their CRC32C."""

    start: int
    end: int
    crc: int


class Ledger:
    """The ranges of one file read so far; thread-safe, as reads land from a pool."""

    def __init__(self, size: int, crc: str, *, where: str, step: int, path: str) -> None:
        self.size, self.crc, self.where, self.step, self.path = size, crc, where, step, path
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def record(self, start: int, data: bytes | memoryview) -> None:
        """Note that ``data`` was read at ``start``."""
        if len(data):
            span = Span(start, start + len(data), crc32c.crc32c(data))
            with self._lock:
                self._spans.append(span)

    def finish(self, read: Callable[[int, int], Iterator[bytes | memoryview]]) -> int:
        """Read what was not read, check it all against the manifest; returns the bytes read
        here. ``read(start, end)`` yields the file's bytes ``[start, end)`` in pieces."""
        with self._lock:
            spans = sorted(set(self._spans), key=lambda s: (s.start, s.end))
        pieces: list[Span] = []
        extra = 0
        position = 0
        for cluster in _clusters(spans):
            start, end = cluster[0].start, max(s.end for s in cluster)
            if start > position:
                pieces.append(self._read(read, position, start))
                extra += start - position
            if len({(s.start, s.end) for s in cluster}) == 1:
                self._same(cluster)
                pieces.append(cluster[0])
            else:
                pieces.append(self._reread(read, cluster, start, end))
                extra += end - start
            position = end
        if position < self.size:
            pieces.append(self._read(read, position, self.size))
            extra += self.size - position
        self._check(pieces)
        return extra

    def _read(
        self, read: Callable[[int, int], Iterator[bytes | memoryview]], a: int, b: int
    ) -> Span:
        crc = 0
        got = a
        for piece in read(a, b):
            crc = crc32c.crc32c(piece, crc)
            got += len(piece)
        if got != b:
            raise self._error(f"reading bytes {a}..{b} returned {got - a}: the file is shorter")
        return Span(a, b, crc)

    def _reread(
        self,
        read: Callable[[int, int], Iterator[bytes | memoryview]],
        cluster: list[Span],
        start: int,
        end: int,
    ) -> Span:
        """Overlapping reads: read their union once; each must match its part of it."""
        data = b"".join(bytes(p) for p in read(start, end))
        if len(data) != end - start:
            raise self._error(f"reading bytes {start}..{end} returned {len(data)}")
        for span in cluster:
            if crc32c.crc32c(data[span.start - start : span.end - start]) != span.crc:
                raise self._changed(span)
        return Span(start, end, crc32c.crc32c(data))

    def _same(self, cluster: list[Span]) -> None:
        for span in cluster[1:]:
            if span.crc != cluster[0].crc:
                raise self._changed(span)

    def _check(self, pieces: list[Span]) -> None:
        crc = 0
        size = 0
        for piece in pieces:
            crc = crc32c_combine(crc, piece.crc, piece.end - piece.start)
            size += piece.end - piece.start
        if size != self.size:
            raise self._error(f"{size} bytes read, the manifest says {self.size}")
        if f"{crc:08x}" != self.crc:
            raise CorruptCheckpointError(
                f"{self.where}: checksum mismatch (crc32c {crc:08x} of the ranges read, manifest "
                f"of step {self.step} says {self.crc}); the bytes are corrupt, nothing was "
                "exported. Export an earlier step",
                uri=self.where,
                step=self.step,
                path=self.path,
            )

    def _changed(self, span: Span) -> CorruptCheckpointError:
        return self._error(
            f"bytes {span.start}..{span.end} differ between two reads: the object changed "
            "while it was exported"
        )

    def _error(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: {what}; nothing was exported. Export again, or an earlier step",
            uri=self.where,
            step=self.step,
            path=self.path,
        )


def _clusters(spans: list[Span]) -> Iterator[list[Span]]:
    """Runs of spans (sorted by start) that overlap one another."""
    cluster: list[Span] = []
    end = -1
    for span in spans:
        if cluster and span.start >= end:
            yield cluster
            cluster = []
        cluster.append(span)
        end = max(end, span.end) if len(cluster) > 1 else span.end
    if cluster:
        yield cluster


__all__ = ["Ledger", "Span", "crc32c_combine"]
