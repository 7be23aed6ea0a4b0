"""What a caller hands over to be written: payload files as producers of bytes.

``stage_files``, ``push_dir``, the distributed savers and the integrations all describe their
files this way, so none of them needs the commit engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptstore.backends.base import Chunk

Progress = Callable[[int], None]
"""Called with a number of bytes just transferred (CLI progress bars)."""


@dataclass(frozen=True)
class SourceFile:
    """A payload file to write: path in the step, a producer of its bytes, its size if known."""

    path: str
    chunks: Callable[[], Iterable[Chunk]]
    size: int | None = None
    stable: bool = False
    """Its chunks stay valid and unchanged until the write returns (views of a save's
    tensors, immutable bytes): a backend may send them where they lie, without a copy."""


def iter_file(read: Callable[[int], bytes], chunk_size: int = 1 << 22) -> Iterator[bytes]:
    """Chunks from a ``read(n)`` callable until it returns nothing."""
    while chunk := read(chunk_size):
        yield chunk


def file_reader(path: Path) -> Callable[[], Iterator[bytes]]:
    """A producer of a local file's bytes, opened anew on each call (a retry re-reads it)."""

    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from iter_file(f.read)

    return chunks
