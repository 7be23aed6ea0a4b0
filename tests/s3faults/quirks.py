"""S3-compatible servers that are not S3, emulated by the fault proxy (its ``quirk=``).

Each quirk rewrites or refuses requests and responses the way one kind of server differs from
S3. The proxy strips or rewrites some signed headers to do so; moto does not verify signatures,
a real server would refuse such requests.
"""

from __future__ import annotations

import re
from email.message import Message

QUIRKS = {
    "complete-ignores-if-none-match": "CompleteMultipartUpload ignores If-None-Match",
    "put-ignores-conditions": "PutObject ignores If-Match and If-None-Match",
    "if-match-unquoted-only": "If-Match matches only an unquoted ETag (a quoted one gets 412)",
    "complete-empty-etag": "CompleteMultipartUpload answers an empty ETag",
    "no-checksums": "x-amz-checksum-* are ignored and never returned",
    "no-upload-listing": "ListMultipartUploads and AbortMultipartUpload answer 501",
}
_CHECKSUM_XML = re.compile(rb"<Checksum\w*>[^<]*</Checksum\w*>")
_ETAG_XML = re.compile(rb"<ETag>[^<]*</ETag>")


def refusal(quirk: str | None, op: str, headers: Message) -> str | None:
    """The error the emulated server answers instead of forwarding, if any."""
    if quirk == "no-upload-listing" and op in ("ListMultipartUploads", "AbortMultipartUpload"):
        return "501"
    if quirk == "if-match-unquoted-only":
        tag = (headers.get("If-Match") or "").strip()
        if tag.startswith(('"', "W/")):  # compared literally with the stored, unquoted ETag
            return "412"
    return None


def request_headers(
    quirk: str | None, op: str, headers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    ignores = {"complete-ignores-if-none-match": "CompleteMultipartUpload"}
    ignores["put-ignores-conditions"] = "PutObject"
    drop: tuple[str, ...] = ()
    if quirk in ignores and op == ignores[quirk]:
        drop = ("if-none-match", "if-match")
    elif quirk == "no-checksums":
        drop = ("x-amz-checksum-", "x-amz-sdk-checksum-algorithm")
    return [(k, v) for k, v in headers if not k.lower().startswith(drop)] if drop else headers


def request_body(quirk: str | None, op: str, body: bytes) -> bytes:
    if quirk == "no-checksums" and op == "CompleteMultipartUpload":
        return _CHECKSUM_XML.sub(b"", body)
    return body


def rewrites_body(quirk: str | None, op: str) -> bool:
    """Whether the response body is rewritten (so it is read whole, not streamed)."""
    return quirk in ("no-checksums", "complete-empty-etag") and op != "GetObject"


def response_headers(
    quirk: str | None, op: str, headers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    if quirk == "no-checksums":
        return [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum-")]
    if quirk == "complete-empty-etag" and op == "CompleteMultipartUpload":
        return [(k, v) for k, v in headers if k.lower() != "etag"]
    return headers


def response_body(quirk: str | None, op: str, status: int, data: bytes) -> bytes:
    if quirk == "no-checksums":
        return _CHECKSUM_XML.sub(b"", data)
    if quirk == "complete-empty-etag" and op == "CompleteMultipartUpload" and status == 200:
        return _ETAG_XML.sub(b"<ETag></ETag>", data)
    return data
