"""Multipart uploads that a failure left open and the server would not abort: recorded here
until they are.

S3 keeps (and bills) the parts of an upload until it is completed or aborted. A failed upload is
aborted at once (:mod:`.s3_multipart`), but a server that stopped answering does not answer the
abort either. Then the upload is recorded here, and aborted by the backend's next write (the
next save, from its first request), by ``close()``, and by ``gc``, which aborts a recorded
upload however young it is (:attr:`~.base.PartialWrite.abandoned`). A CreateMultipartUpload
given up unanswered may still land and start an upload nobody knows: its key is recorded, and
every upload of that key is aborted later, except one this process is running (two writers
never share a key: DESIGN invariant 9). So no upload of a live save is ever aborted: what is
recorded was given up by its own save.

Why in this process's memory rather than in an object under ``.ckptstore/``: the record is made
when the server does not answer, so it could not be written there then, and once the server
answers again the abort costs no more than writing the record would. The happy path costs no
request: an empty record is one check. What a crash loses, ``gc`` finds by listing (uploads
older than its grace) or the bucket's AbortIncompleteMultipartUpload lifecycle rule removes.
"""

from __future__ import annotations

import threading

UNKNOWN = ""
"""The upload id of a create whose answer was lost: every upload of the key is meant."""
RECORDED = (
    "could not be aborted (the server did not answer): recorded, the next save, close() or "
    "`ckptstore gc` removes it"
)
"""What became of an upload recorded here, for the messages (one sentence)."""
REFUSED = (
    "could not be aborted (the server refused): `ckptstore gc` or an "
    "AbortIncompleteMultipartUpload lifecycle rule removes it"
)
"""What became of an upload whose abort the server answered with an error."""


class Leftovers:
    """One backend's record of uploads to abort, and of its uploads in flight (never aborted
    from here). Thread-safe; :meth:`settling` lets one thread at a time work through it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settle = threading.Lock()
        self._uploads: dict[tuple[str, str], None] = {}  # ordered: oldest first
        self._live: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._uploads)

    def record(self, key: str, upload_id: str) -> None:
        """``upload_id`` of ``key`` is to be aborted (:data:`UNKNOWN`: every upload of it)."""
        with self._lock:
            self._uploads[(key, upload_id)] = None

    def forget(self, key: str, upload_id: str) -> None:
        with self._lock:
            self._uploads.pop((key, upload_id), None)

    def pending(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._uploads)

    def started(self, upload_id: str) -> None:
        with self._lock:
            self._live.add(upload_id)

    def ended(self, upload_id: str) -> None:
        with self._lock:
            self._live.discard(upload_id)

    def live(self, upload_id: str) -> bool:
        with self._lock:
            return upload_id in self._live

    def abandoned(self, key: str, upload_id: str) -> bool:
        """Whether the upload is recorded here (by its id, or by its key) and not running."""
        with self._lock:
            if upload_id in self._live:
                return False
            return (key, upload_id) in self._uploads or (key, UNKNOWN) in self._uploads

    def settling(self) -> bool:
        """Take the turn to abort what is recorded (False: another thread has it); the taker
        calls :meth:`settled` when done."""
        return self._settle.acquire(blocking=False)

    def settled(self) -> None:
        self._settle.release()
