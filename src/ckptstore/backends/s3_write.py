"""One file written to S3: one PutObject, or a parallel multipart upload, chosen as it streams.

A save hands the backend a file as chunks, its length unknown in advance. The chunks are cut
into parts (:func:`.s3_transfer.split`) and held until ``multipart_threshold`` bytes have come:
a file that ends by then goes up in one PutObject (its last piece may run
``s3_options.tail`` bytes past the threshold), anything longer streams, the held parts first,
into a multipart upload (:mod:`.s3_multipart`) with a CRC32C per part. A single PUT holds
one of the transfers' slots while it runs, as a part does, so ``max_concurrency`` bounds both.

Chunks that stay valid until the write returns (``Crc32cChunks.stable``: a save's header and
views of its tensors) are not copied: up to one PUT's worth they go up where they lie, as the
segments of one body; a larger file goes on into parts, those chunks first.

A single PUT's CRC32C is not computed twice: chunks that counted it on the way for the
manifest (:class:`~.checksummed.Crc32cChunks`) hand it over, and the PUT's ``ChecksumCRC32C``
carries it, so the file's bytes are read once for both.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from ckptstore.backends.base import Chunk
from ckptstore.backends.checksummed import Crc32cChunks
from ckptstore.backends.s3_errors import Translator
from ckptstore.backends.s3_options import MAX_SINGLE_PUT, S3Options, tail
from ckptstore.backends.s3_progress import Progress
from ckptstore.backends.s3_transfer import Body, Transfers, drain, split


class FileWrites:
    """How one S3 backend writes a whole file (``S3Backend.write``); errors are translated
    once, here, like every request of the backend (s3_errors.py)."""

    def __init__(self, transfers: Transfers, opts: S3Options, errors: Translator) -> None:
        self._transfers = transfers
        self._opts = opts
        self._errors = errors

    @property
    def held_whole_up_to(self) -> int:
        """The largest file :meth:`write` holds whole before it sends any of it: ``split``
        hands out no piece of a file this size or smaller before its last chunk was taken,
        and until then nothing is sent (neither its PUT nor a multipart upload)."""
        return self._opts.part_size + tail(self._opts.part_size)

    def write(self, key: str, chunks: Iterable[Chunk]) -> int:
        """Write ``chunks`` to ``key``: one PutObject below ``multipart_threshold``, else a
        parallel multipart upload; the bytes written."""
        part_size, threshold = self._opts.part_size, self._opts.multipart_threshold
        single = min(threshold + tail(part_size), MAX_SINGLE_PUT)  # the most one PUT takes
        if isinstance(chunks, Crc32cChunks) and chunks.stable:
            held: list[Chunk] = []
            for chunk in chunks:  # no copy: the chunks stay valid until this returns
                held.append(chunk)
                if chunks.size > single:  # counted as they pass
                    break
            else:
                return self._put(key, held, chunks.size, chunks)
            chunks = itertools.chain(held, chunks)  # too large for one PUT: cut into parts
        transfers, name = self._transfers, self._transfers.name(key)
        parts = split(chunks, part_size)
        head: deque[bytearray] = deque()
        size = 0
        for part in parts:
            head.append(part)
            size += len(part)
            # a whole part means more bytes follow (split cuts one only then); a last piece
            # may run ``tail`` bytes past the threshold and still go up in one PUT
            if size >= threshold and (len(part) == part_size or size > single):
                break
        else:
            return self._put(key, head[0] if len(head) == 1 else b"".join(head), size, chunks)
        with self._errors.translated(name, "write"):
            rest = itertools.chain(drain(head), parts)
            return transfers.upload(key, rest, part_size=self._opts.part_size)

    def _put(self, key: str, body: Body, size: int, chunks: Iterable[Chunk]) -> int:
        """The whole file in one PUT: the CRC32C its chunks carry is the body's."""
        transfers, name = self._transfers, self._transfers.name(key)
        crc = chunks.whole(size) if isinstance(chunks, Crc32cChunks) else None
        checksum = transfers.part_checksum(body, crc) if crc is not None else {}
        progress = Progress(name, "write")
        with self._errors.translated(name, "write"), transfers.slot(progress):
            transfers.put(key, body, **checksum)  # a PUT holds a slot, as a part does
        return size
