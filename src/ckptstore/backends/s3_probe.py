"""What an S3-compatible server really does with conditional writes, found by trying.

AWS S3 honours ``If-None-Match: *`` and ``If-Match: <etag>`` on PutObject; some compatible
servers ignore one or both (the PUT silently overwrites), reject them (501), or accept only an
unquoted ETag in ``If-Match``. Trusting a header the server ignores would let two writers both
"commit" a step, so the backend asks once, on its first create or swap, with a throwaway object:

1. PUT with ``If-None-Match: *`` on a fresh key: must succeed;
2. the same PUT again: must be refused (412) -- else create-only writes are not atomic;
3. PUT with ``If-Match`` and a wrong ETag: must be refused -- else swap is not a CAS;
4. PUT with ``If-Match`` and the right ETag, quoted; if refused, unquoted;
5. with checksums on, PUT with a wrong CRC32C: must be refused (400 BadDigest) -- else the
   server stores what it was sent without checking (moto does: it echoes the value back).

What the answers mean, the backend's :class:`~.base.Capabilities` and a warning for each
guarantee lost, is decided here too (:func:`capabilities`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from ckptstore.backends.base import Capabilities
from ckptstore.backends.s3_errors import code_of, is_refused, is_unsupported, status_of

logger = logging.getLogger(__name__)

PROBE_PREFIX = ".ckptstore/probe-"
"""The probe objects' paths under a store's root, each ``<prefix><uuid>``: listings leave them
out, and ``gc`` removes those a process killed mid-probe left."""
Put = Callable[..., dict[str, Any]]
"""PUT the probe object with these extra PutObject parameters; returns the response."""
_BAD_CHECKSUM = frozenset({"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest"})


@dataclass(frozen=True)
class ProbeResult:
    atomic_create: bool
    atomic_swap: bool
    unquoted_if_match: bool
    server_checksums: bool


def bare(etag: str) -> str:
    """An ETag without quotes or weak marker, for comparing and for unquoted ``If-Match``."""
    return etag.strip().removeprefix("W/").strip('"')


def probe(
    put: Put, etag_of: Callable[[dict[str, Any]], str], *, wrong_crc32c: str | None
) -> ProbeResult:
    """Run the steps above; ``etag_of`` reads the ETag from a PUT response (or asks HEAD).

    ``wrong_crc32c`` (None: checksums are off) is a valid CRC32C of other bytes.
    """
    # The key is new, so a refused first PUT means a retry of ours found our own first attempt
    # (its answer was lost): only a server that honours the header refuses. ``{}``: unsupported.
    first = _attempt(put, IfNoneMatch="*")
    again = _attempt(put, IfNoneMatch="*") if first != {} else None
    create_ok = first != {} and again is None
    etag = etag_of(again or first or {})
    unquoted = False
    wrong = _attempt(put, IfMatch=f'"{uuid.uuid4().hex}"')
    swap_ok = wrong is None
    if swap_ok and _attempt(put, IfMatch=f'"{bare(etag)}"') is None:
        unquoted = swap_ok = _attempt(put, IfMatch=bare(etag)) is not None
    checks = wrong_crc32c is not None and bool(first and first.get("ChecksumCRC32C"))
    if checks:
        try:
            put(ChecksumCRC32C=wrong_crc32c)
            checks = False
        except ClientError as e:
            if status_of(e) != 400 and code_of(e) not in _BAD_CHECKSUM:
                raise
    return ProbeResult(
        atomic_create=create_ok,
        atomic_swap=swap_ok,
        unquoted_if_match=unquoted,
        server_checksums=checks,
    )


def _attempt(put: Put, **condition: str) -> dict[str, Any] | None:
    """The response of a conditional PUT, None if refused, ``{}`` if the header is unsupported."""
    try:
        return put(**condition)
    except ClientError as e:
        if is_refused(e):
            return None
        if is_unsupported(e):
            put()  # the server rejects the header: count it as ignored
            return {}
        raise


def lost_guarantees(result: ProbeResult, where: str, checksums: bool) -> list[tuple[str, str]]:
    """``(topic, warning)`` for each guarantee the server does not give."""
    lost = []
    if not result.atomic_create:
        lost.append(
            (
                "create",
                f"{where} ignores If-None-Match on PutObject: committing a step is not atomic "
                "against writers in other processes; falling back to HEAD + PUT + read-back, "
                "which has a race window. Use one writer per store on this server.",
            )
        )
    if not result.atomic_swap:
        lost.append(
            (
                "swap",
                f"{where} does not honour If-Match on PutObject: moving `latest` is not a "
                "compare-and-swap against other processes; falling back to HEAD + compare + "
                "PUT. Readers still fall back to the newest committed manifest.",
            )
        )
    if checksums and not result.server_checksums:
        lost.append(
            (
                "checksums",
                f"{where} does not verify the CRC32C of uploads (it accepted a wrong one, or "
                "returned none); corruption in transit is caught when a step is loaded, since "
                "ckptstore verifies CRC32C on load.",
            )
        )
    return lost


def capabilities(
    result: ProbeResult,
    where: str,
    *,
    checksums: bool,
    parallel_writes: int,
    warn: Callable[[str, str], None],
) -> Capabilities:
    """What the backend may rely on after ``result``. Each lost guarantee goes to ``warn(topic,
        message)`` (the backend warns once per topic); unverified checksums are only logged at INFO,
    since loads verify every byte anyway (and a CLI run against a test server would repeat it)."""
    if result.unquoted_if_match:
        logger.info("%s accepts only unquoted ETags in If-Match; using those", where)
    for topic, message in lost_guarantees(result, where, checksums):
        if topic == "checksums":  # no guarantee is lost (loads verify CRC32C): not a warning
            logger.info("%s", message)
        else:
            warn(topic, message)
    return Capabilities(
        atomic_create=result.atomic_create,
        atomic_swap=result.atomic_swap,
        server_checksums=checksums and result.server_checksums,
        server_side_copy=True,
        parallel_writes=parallel_writes,
    )
