"""The one multipart skeleton, which uploads and server-side copies share.

A multipart operation starts an upload, sends its parts on the backend's pool (at most
``max_concurrency`` in flight, each holding one of the backend's slots), and completes the
upload with the parts in order. On any failure (a part out of retries, the deadline, Ctrl-C) it
cancels the running parts (they stop at their next block: :mod:`.s3_progress`), gives them
:data:`ABORT_GRACE` to do so, and aborts the upload under a short deadline of its own: S3 never
shows a partial object, but bills and keeps the parts of an unfinished upload until someone
aborts it. A part still blocked in a socket call may land after that abort, so the upload is
aborted once more when the last such part has ended. An abort the server does not answer (it
stopped) is recorded, and the upload aborted by the backend's next write, ``close()`` or ``gc``
(:mod:`.s3_leftovers`, :meth:`Multipart.settle`); the error says which happened. ``gc`` finds
what a killed process left (:meth:`Multipart.unfinished`).

Two answers can be lost in transit. A CreateMultipartUpload that landed unanswered leaves an
upload nobody knows: when creating took more than one attempt, other uploads of the very same
key are aborted (two writers never share a key: DESIGN invariant 9); when it was given up
unanswered, the key is recorded and its uploads aborted later. A
CompleteMultipartUpload that landed unanswered makes its retry find no upload: then the object
itself is looked for.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from botocore.exceptions import ClientError

from ckptstore.backends.s3_errors import is_not_found
from ckptstore.backends.s3_leftovers import RECORDED, REFUSED, UNKNOWN, Leftovers
from ckptstore.backends.s3_options import MAX_PART_SIZE
from ckptstore.backends.s3_progress import Meter, Progress, ProgressBody
from ckptstore.backends.s3_retry import Retrier
from ckptstore.deadline import Deadline, bounded, current_deadline, submit
from ckptstore.errors import ConfigError, DeadlineExceededError

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000
ABORT_GRACE = 0.5
"""Seconds a failed upload gives its cancelled parts to stop before it is aborted."""
ABORT_TIMEOUT = 10.0
"""The longest the AbortMultipartUpload after a failure may take (``stall_timeout`` if less,
1 s at least): with :data:`ABORT_GRACE`, the margin by which a timed-out upload outlives its
deadline. Past it, the upload is recorded (:mod:`.s3_leftovers`)."""
SETTLE_MIN = 2.0
"""Seconds a deadline in force must leave for a write to abort recorded uploads first."""
Part = dict[str, Any]
"""One entry of CompleteMultipartUpload's part list: ``PartNumber``, ``ETag``, checksums."""
PartJob = Callable[[str, int], Part]
"""Sends part ``number`` of upload ``upload_id`` (the arguments, in that order)."""
Upload = tuple[str, str, "float | None"]
"""An unfinished upload: its key, its upload id, and when it started."""


class PartRequests(Protocol):
    """What a multipart operation needs of the backend's :class:`~.s3_transfer.Transfers`
    (which calls this module, so the type is spelled out here): its requests and retry loop,
    its pool with the slots that bound the parts in flight, and its checksum settings."""

    limit: int
    checksums: bool
    stall_timeout: float
    retrier: Retrier
    slots: threading.BoundedSemaphore
    leftovers: Leftovers

    def name(self, key: str) -> str: ...

    def request(self, method: str, **params: Any) -> dict[str, Any]: ...

    def call(self, method: str, key: str, doing: str, **params: Any) -> dict[str, Any]: ...

    def pages(
        self, method: str, key: str, doing: str, **params: Any
    ) -> Iterator[dict[str, Any]]: ...

    def pool(self) -> ThreadPoolExecutor: ...

    def acquire(self, progress: Progress) -> None: ...

    def wait(
        self, futures: set[Future[Any]], progress: Progress, return_when: str
    ) -> tuple[set[Future[Any]], set[Future[Any]]]: ...

    def part_checksum(self, data: bytes | bytearray) -> dict[str, str]: ...


class UploadCleanup:
    """Ending uploads that will not complete: aborted at once when the server answers,
    recorded (:mod:`.s3_leftovers`) and settled by a later write when it does not."""

    def __init__(self, moves: PartRequests) -> None:
        self.moves = moves

    def unfinished(self, prefix: str) -> list[Upload]:
        """Every unfinished multipart upload whose key starts with ``prefix``."""
        found: list[Upload] = []
        doing = "list unfinished uploads under"
        for page in self.moves.pages("list_multipart_uploads", prefix, doing, Prefix=prefix):
            for up in page.get("Uploads", ()):
                started = up.get("Initiated")
                found.append(
                    (str(up["Key"]), str(up["UploadId"]), started.timestamp() if started else None)
                )
        return found

    def abort(self, key: str, upload_id: str) -> None:
        """Abort an unfinished upload; one that is already gone is not an error."""
        doing = "abort the upload of"
        try:
            self.moves.call("abort_multipart_upload", key, doing, Key=key, UploadId=upload_id)
        except ClientError as e:
            if not is_not_found(e):  # NoSuchUpload
                raise
        self.moves.leftovers.forget(key, upload_id)

    def settle(self) -> None:
        """Abort the uploads recorded when the server did not answer (:mod:`.s3_leftovers`),
        each under a short deadline of its own, never past the caller's; stop at the first
        that gets no answer (the next write tries again). Never raises: the caller's own
        requests tell what is wrong.
        A thread that finds another settling goes on at once."""
        leftovers = self.moves.leftovers
        outer = current_deadline()
        if outer is not None and outer.remaining() < SETTLE_MIN:
            return  # the caller's deadline leaves no time to spare: a later write settles
        if not leftovers or not leftovers.settling():
            return
        try:
            for key, upload_id in leftovers.pending():
                try:
                    with bounded(self._cleanup_deadline(outer.remaining() if outer else None)):
                        if upload_id != UNKNOWN:
                            self.abort(key, upload_id)
                            continue
                        for other_key, other, _ in self.unfinished(key):
                            if other_key == key and not leftovers.live(other):
                                self.abort(key, other)
                        leftovers.forget(key, UNKNOWN)
                except ClientError as e:  # an answer: no later try does better
                    leftovers.forget(key, upload_id)
                    logger.warning(
                        "multipart upload %s of %s %s (%s)",
                        upload_id or "(unknown)",
                        self.moves.name(key),
                        REFUSED,
                        type(e).__name__,
                    )
                except Exception as e:
                    logger.debug("recorded uploads not aborted yet: %s", e)
                    return
        finally:
            leftovers.settled()

    def _abort_after_failure(
        self, key: str, upload_id: str, inflight: set[Future[Part]], progress: Progress
    ) -> str | None:
        """Cancel the running parts, give them a moment, abort; abort again once the last
        straggler has ended. Returns None if aborted, else what became of the upload (for the
        error, which the caller raises)."""
        progress.token.cancel("its upload was aborted")
        for future in inflight:
            future.cancel()
        wait(inflight, timeout=ABORT_GRACE)
        fate = self._abort_quietly(key, upload_id)
        stragglers = [f for f in inflight if not f.done()]
        if not stragglers:
            return fate
        left = [len(stragglers)]
        lock = threading.Lock()

        def ended(_: Future[Part]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            self._abort_quietly(key, upload_id)

        for future in stragglers:
            future.add_done_callback(ended)
        return fate

    def _cleanup_deadline(self, cap: float | None = None) -> Deadline:
        """A short deadline of its own for an abort (the save's may have passed), ``cap``
        seconds at most."""
        outer = current_deadline()
        seconds = max(1.0, min(ABORT_TIMEOUT, self.moves.stall_timeout))
        return Deadline.after(
            seconds if cap is None else min(seconds, cap),
            operation=outer.operation if outer else "save",
            rank=outer.rank if outer else None,
        )

    def _abort_quietly(self, key: str, upload_id: str) -> str | None:
        """Abort under a short deadline of its own; None if done, else what became of the
        upload: recorded if the server did not answer (:mod:`.s3_leftovers`)."""
        try:
            with bounded(self._cleanup_deadline()):
                self.abort(key, upload_id)
        except ClientError as e:  # an answer, and a refusal: no later try does better
            logger.debug("abort of %s refused: %s", upload_id, e)
            return f"{REFUSED} ({type(e).__name__}: {e})"
        except Exception as e:
            self.moves.leftovers.record(key, upload_id)
            logger.debug("abort of %s unanswered (%s): recorded", upload_id, type(e).__name__)
            return RECORDED
        logger.debug("aborted multipart upload %s of %s", upload_id, self.moves.name(key))
        return None


class Multipart(UploadCleanup):
    """Multipart uploads and copies on one backend's :class:`~.s3_transfer.Transfers`."""

    def upload(self, key: str, parts: Iterator[bytearray], *, part_size: int) -> int:
        """A multipart upload of ``parts``, each with its CRC32C if checksums are on; returns
        the bytes uploaded."""
        size = 0
        progress = Progress(self.moves.name(key), "write")

        def jobs() -> Iterator[functools.partial[Part]]:
            nonlocal size
            for part in parts:
                size += len(part)
                job = functools.partial(self._upload_part, key, part, progress)
                del part  # only the job holds the part, and only until it is uploaded
                yield job
                del job

        extra = {"ChecksumAlgorithm": "CRC32C"} if self.moves.checksums else {}
        self.run(key, jobs(), part_size=part_size, progress=progress, start=extra)
        return size

    def copy(self, origin: dict[str, str], target: str, size: int, *, part_size: int) -> None:
        """Server-side copy of ``origin`` (its bucket and key) in parallel UploadPartCopy parts
        (CopyObject stops at 5 GiB)."""
        step = max(part_size, -(-size // MAX_PARTS))
        progress = Progress(self.moves.name(target), "copy")
        jobs = (
            functools.partial(
                self._copy_part, origin, target, f"bytes={a}-{min(a + step, size) - 1}", progress
            )
            for a in range(0, size, step)
        )
        self.run(target, jobs, part_size=step, progress=progress)

    def run(
        self,
        key: str,
        jobs: Iterable[PartJob],
        *,
        part_size: int,
        progress: Progress | None = None,
        start: dict[str, str] | None = None,
    ) -> int:
        """Start an upload of ``key`` (``start``: extra CreateMultipartUpload parameters), run
        ``jobs`` as parts 1, 2, ... on the pool, complete it; returns the number of parts.

        ``jobs`` is consumed lazily, one job per free slot, so a job may hold its part's bytes.
        """
        moves = self.moves
        name = moves.name(key)
        progress = progress or Progress(name, "write")
        upload_id = self._create(key, progress, start or {})
        pool = moves.pool()
        inflight: set[Future[Part]] = set()
        done: list[Part] = []
        moves.leftovers.started(upload_id)
        try:
            for number, job in enumerate(jobs, start=1):
                if number > MAX_PARTS:
                    raise ConfigError(
                        f"{name} needs more than {MAX_PARTS} parts of {part_size} bytes; raise "
                        f"the storage option part_size (up to {MAX_PART_SIZE}) for objects "
                        "this large",
                        uri=name,
                    )
                while len(inflight) >= moves.limit:  # bounded memory: wait for a free slot
                    finished, inflight = moves.wait(inflight, progress, FIRST_COMPLETED)
                    done.extend(f.result() for f in finished)
                moves.acquire(progress)  # a slot, shared with the other files
                try:
                    future = submit(pool, job, upload_id, number)
                except BaseException:
                    moves.slots.release()
                    raise
                future.add_done_callback(lambda _: moves.slots.release())
                inflight.add(future)
                del job  # the future holds the part now, and only while it runs
            finished, inflight = moves.wait(inflight, progress, FIRST_EXCEPTION)
            done.extend(f.result() for f in finished)
            done.sort(key=lambda p: int(p["PartNumber"]))
            self._complete(key, upload_id, done, progress)
        except BaseException as e:
            moves.leftovers.ended(upload_id)
            self._failed(e, key, upload_id, inflight, progress)
            raise
        moves.leftovers.ended(upload_id)
        logger.debug("multipart upload of %s done: %d parts", name, len(done))
        return len(done)

    def _failed(
        self,
        error: BaseException,
        key: str,
        upload_id: str,
        inflight: set[Future[Part]],
        progress: Progress,
    ) -> None:
        """Abort the upload ``error`` ended; raise the deadline's error saying what became of
        the upload, or warn. The caller raises ``error`` if this returns."""
        fate = self._abort_after_failure(key, upload_id, inflight, progress)
        if fate is None:
            return
        deadline = current_deadline()
        if isinstance(error, DeadlineExceededError) and error.upload_id == upload_id and deadline:
            progress.upload_left = fate  # the error says what became of the upload
            raise progress.deadline_error(deadline) from error.__cause__
        logger.warning("multipart upload %s of %s %s", upload_id, self.moves.name(key), fate)

    # -- the steps ----------------------------------------------------------------------------

    def _create(self, key: str, progress: Progress, start: dict[str, str]) -> str:
        """CreateMultipartUpload; after more than one attempt, abort other uploads of ``key``."""
        attempts = 0

        def attempt() -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            return self.moves.request("create_multipart_upload", Key=key, **start)

        try:
            resp = self.moves.retrier.call("CreateMultipartUpload", attempt, progress)
        except ClientError:
            raise  # answered: no upload was started
        except BaseException:  # unanswered: it may still land, and start an upload of key
            self.moves.leftovers.record(key, UNKNOWN)
            raise
        upload_id = progress.upload_id = str(resp["UploadId"])
        logger.debug("multipart upload %s of %s started", upload_id, progress.target)
        if attempts > 1:
            try:
                for other_key, other, _ in self.unfinished(key):
                    if other_key == key and other != upload_id:
                        self.abort(key, other)
            except Exception as e:  # gc finds it later
                logger.warning("could not look for a lost upload of %s: %s", progress.target, e)
        return upload_id

    def _complete(self, key: str, upload_id: str, parts: list[Part], progress: Progress) -> None:
        """CompleteMultipartUpload; a retry that finds no upload looks for the object."""
        attempts = 0

        def attempt() -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            return self.moves.request(
                "complete_multipart_upload",
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )

        try:
            self.moves.retrier.call("CompleteMultipartUpload", attempt, progress)
        except ClientError as e:
            if not (attempts > 1 and is_not_found(e)):
                raise
            try:  # the first attempt completed it, its answer was lost
                self.moves.call("head_object", key, "write", Key=key)
            except ClientError:
                raise e from None

    def _upload_part(
        self, key: str, data: bytearray, progress: Progress, upload_id: str, number: int
    ) -> Part:
        moves = self.moves
        entry: Part = {"PartNumber": number, **moves.part_checksum(data)}
        extra = {"ChecksumAlgorithm": "CRC32C", **entry} if moves.checksums else {}
        extra.pop("PartNumber", None)

        def attempt() -> dict[str, Any]:
            body = ProgressBody(data, Meter(moves.stall_timeout, len(data), progress.token))
            return moves.request(
                "upload_part", Key=key, UploadId=upload_id, PartNumber=number, Body=body, **extra
            )

        resp = moves.retrier.call(f"UploadPart {number}", attempt, progress)
        progress.add(len(data))
        entry["ETag"] = resp["ETag"]
        return entry

    def _copy_part(
        self,
        origin: dict[str, str],
        target: str,
        byte_range: str,
        progress: Progress,
        upload_id: str,
        n: int,
    ) -> Part:
        out = self.moves.retrier.call(
            f"UploadPartCopy {n}",
            functools.partial(
                self.moves.request,
                "upload_part_copy",
                Key=target,
                UploadId=upload_id,
                PartNumber=n,
                CopySource=origin,
                CopySourceRange=byte_range,
            ),
            progress,
        )
        return {"PartNumber": n, "ETag": out["CopyPartResult"]["ETag"]}
