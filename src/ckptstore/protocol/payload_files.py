"""One save attempt's payload files, each written with its checksums counted as its bytes pass,
or copied from the previous step where its bytes are the same (commit.py's step 1).

A file the previous step lists with the same path and size may be unchanged (an incremental
save). Where the backend holds such a file whole before it sends any of it
(``Backend.sends_whole_up_to``), the comparison rides on the one pass that feeds the request
(:class:`_UnlessSame`); a larger file is read once first to compare, then written or copied.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from ckptstore.backends.base import Backend, Chunk, chunk_size
from ckptstore.backends.checksummed import Crc32cChunks
from ckptstore.data.payload import Progress, SourceFile
from ckptstore.domain import layout
from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.manifest import FileEntry
from ckptstore.domain.plan import Previous


class PayloadFiles:
    """Writes the files of one attempt of ``step``; :meth:`write` runs in several threads."""

    def __init__(
        self,
        backend: Backend,
        step: int,
        attempt: str,
        previous: Previous | None,
        digests: bool,
        progress: Progress | None,
    ) -> None:
        self.backend, self.step, self.attempt = backend, step, attempt
        self.from_step = previous.step if previous is not None else None
        self.earlier = {f.path: f for f in previous.files} if previous is not None else {}
        self.digests = digests
        """Record a SHA-256 of every file (signed stores); match unchanged files by it."""
        self.progress = progress

    def write(self, source: SourceFile) -> FileEntry:
        """``source`` written into the attempt (or copied from the previous step): its entry."""
        path = layout.payload_path(self.step, source.path, self.attempt)
        old = self._candidate(source)
        if old is not None and old.size > self.backend.sends_whole_up_to:  # a pass of its own
            if self._same_bytes(source, old):
                return self._copy(old, path, self.progress)
            old = None
        sha = hashlib.sha256() if self.digests else None
        chunks = source.chunks() if sha is None else _digested(source.chunks(), sha)
        # the manifest's CRC32C, counted as the bytes pass; a backend that sends the file in
        # one request uses it as the request's checksum (backends/checksummed.py). With
        # ``old``, the backend holds the whole file before it sends any of it: the last chunk
        # raises _Unchanged instead, where the bytes are ``old``'s, and the file is copied
        passing = _reporting(chunks, self.progress) if self.progress else chunks
        stable = source.stable
        counted = (
            Crc32cChunks(passing, stable=stable)
            if old is None
            else _UnlessSame(passing, old, sha, stable=stable)
        )
        try:
            size = self.backend.write(path, counted)
        except _Unchanged:
            assert old is not None
            return self._copy(old, path, None)  # progress had its bytes
        digest = sha.hexdigest() if sha is not None else None
        return FileEntry(source.path, size, f"{counted.value:08x}", None, self.attempt, digest)

    def _candidate(self, source: SourceFile) -> FileEntry | None:
        """The previous step's entry ``source`` may equal: same path and size (and a SHA-256
        to match by, in a signed store); ``None``: it is written."""
        old = self.earlier.get(source.path)
        if self.from_step is None or old is None or old.size != source.size:
            return None
        if self.digests and old.sha256 is None:
            return None
        return old

    def _copy(self, old: FileEntry, path: str, progress: Progress | None) -> FileEntry:
        """``old``'s file copied into this step (server-side on S3, a hard link locally)."""
        assert self.from_step is not None
        self.backend.copy(old.key(self.from_step), path)
        if progress:
            progress(old.size)
        return FileEntry(old.path, old.size, old.crc32c, self.from_step, self.attempt, old.sha256)

    def _same_bytes(self, source: SourceFile, old: FileEntry) -> bool:
        """Whether ``source`` holds the bytes ``old`` lists (by SHA-256 when digests are on)."""
        crc, sha = Crc32c(), hashlib.sha256() if self.digests else None
        for _ in _hashed(source.chunks(), crc, sha):
            pass
        if sha is not None:
            return sha.hexdigest() == old.sha256
        return crc.hexdigest() == old.crc32c


class _Unchanged(Exception):
    """Raised by a file's chunks as the last is taken: its bytes are the previous step's."""


class _UnlessSame(Crc32cChunks):
    """:class:`Crc32cChunks` that, once every chunk was taken, raises :class:`_Unchanged`
    where size, CRC32C and SHA-256 (``sha``, fed as the chunks pass, when digests are on)
    equal ``old``'s: the check that would otherwise read the file a first time, on the one
    pass that also copies it into the request."""

    def __init__(
        self, chunks: Iterable[Chunk], old: FileEntry, sha: hashlib._Hash | None, *, stable: bool
    ) -> None:
        super().__init__(chunks, stable=stable)
        self.old, self.sha = old, sha

    def __next__(self) -> Chunk:
        try:
            return super().__next__()
        except StopIteration:
            old = self.old
            same = self.size == old.size and f"{self.value:08x}" == old.crc32c
            if same and (self.sha is None or self.sha.hexdigest() == old.sha256):
                raise _Unchanged from None
            raise


def _hashed(chunks: Iterable[Chunk], crc: Crc32c, sha: hashlib._Hash | None) -> Iterator[Chunk]:
    """Pass ``chunks`` through, updating the checksums with each."""
    for chunk in chunks:
        crc.update(chunk)
        if sha is not None:
            sha.update(chunk)
        yield chunk


def _digested(chunks: Iterable[Chunk], sha: hashlib._Hash) -> Iterator[Chunk]:
    """Pass ``chunks`` through, updating the SHA-256 with each."""
    for chunk in chunks:
        sha.update(chunk)
        yield chunk


def _reporting(chunks: Iterable[Chunk], progress: Progress) -> Iterator[Chunk]:
    for chunk in chunks:
        yield chunk
        progress(chunk_size(chunk))
