"""botocore errors -> ckptstore errors, by exception type, S3 error code and HTTP status.

The one place the S3 backend translates errors. Never by message text: S3-compatible servers
word their messages differently, but agree on codes and statuses. The retry loop
(:mod:`.s3_retry`) has already retried what it retries, so ``retryable`` tells the caller
whether trying again later (a new save, a resume) may help. A deadline that passed is our error
already (SaveTimeoutError, LoadTimeoutError); it only gains the store-relative ``path`` here.
A 403 is always AccessDeniedError, never "missing": an expired token must not read as "no
checkpoint here, start from step 0". An endpoint that never answered this process and stays
silent past ``first_byte_timeout`` (:class:`NoAnswer`, raised by the retry loop) is a
BackendError that is not retryable: a wrong ``endpoint_url`` does not heal by trying again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from ckptstore.backends.s3_progress import Cancelled, Stalled, cause
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    ConfigError,
    DeadlineExceededError,
    ErrorContext,
    NotFoundError,
    PreconditionFailedError,
)

NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})
DENIED = frozenset(
    [
        "AccessDenied",
        "403",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "RequestExpired",
        "ExpiredTokenException",
    ]
)
EXPIRED = frozenset(
    [
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
        "InvalidToken",
        "TokenRefreshRequired",
    ]
)
"""The key the request was signed with expired (or the token was replaced): renew the
credentials and retry (s3_retry.py, s3_credentials.py); past the renewals, access denied."""
CONFLICT = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
RETRYABLE = frozenset(
    [
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "BadDigest",
        "XAmzContentChecksumMismatch",
        "OperationAborted",
    ]
)
UNSUPPORTED = frozenset({"NotImplemented", "MethodNotAllowed"})
_NO_CREDENTIALS = (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)


class NoAnswer(BotoCoreError):  # type: ignore[misc]  # botocore has no types
    """An endpoint that has not answered this process stayed silent for ``first_byte_timeout``
    seconds, retries included: it accepted no connection (``accepted`` False), or accepted one
    and sent no byte of an answer (True), or the attempt was given up in between (None)."""

    fmt = "no answer within {seconds:g} s (first_byte_timeout); last error: {last_error}"

    def __init__(self, *, seconds: float, accepted: bool | None, last_error: str | None) -> None:
        super().__init__(seconds=seconds, accepted=accepted, last_error=last_error)
        self.seconds, self.accepted, self.last_error = seconds, accepted, last_error


def code_of(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def status_of(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_not_found(e: ClientError) -> bool:
    """A missing object (or upload); a missing bucket is not, it is a configuration problem."""
    return code_of(e) in NOT_FOUND or (status_of(e) == 404 and code_of(e) != "NoSuchBucket")


def is_refused(e: ClientError) -> bool:
    """A conditional request the server refused: 412, or 409 for a concurrent conflict."""
    return code_of(e) in CONFLICT or status_of(e) in (409, 412)


def is_unsupported(e: ClientError) -> bool:
    return code_of(e) in UNSUPPORTED or status_of(e) in (405, 501)


def context(target: str, store_uri: str | None = None) -> ErrorContext:
    """The ``uri`` and ``path`` attributes of an error about ``target``.

    ``target`` is the ``s3://`` URI of the object (or store) the operation was about, or a
    phrase such as ``"3 object(s) under s3://bucket/run"``; ``store_uri`` the store's URI, where
    known. The ``path`` is the key relative to the store, so only known with ``store_uri``; an
    error about the store itself, or about several objects, carries the store's URI and no path.
    """
    uri = target if target.startswith(("s3://", "s3a://")) else store_uri
    path = None
    if store_uri and uri and uri.startswith(f"{store_uri.rstrip('/')}/"):
        path = uri[len(store_uri.rstrip("/")) + 1 :]
    return {"uri": uri, "path": path}


def translate(
    e: BaseException,
    *,
    bucket: str,
    endpoint: str,
    target: str,
    action: str,
    store_uri: str | None = None,
) -> CheckpointError:
    """Our error for a botocore one; ``target`` is the ``s3://`` URI the operation was about,
    ``store_uri`` the store's (for the errors' ``path``: :func:`context`)."""
    where = context(target, store_uri)
    if isinstance(e, ClientError):
        message = str(e.response.get("Error", {}).get("Message", "") or "")
        return error_for(
            code_of(e),
            status_of(e),
            bucket=bucket,
            endpoint=endpoint,
            target=target,
            action=action,
            message=message,
            store_uri=store_uri,
        )
    if isinstance(e, _NO_CREDENTIALS):
        return AccessDeniedError(
            f"no usable AWS credentials to {action} {target} ({type(e).__name__}): boto3 "
            "looks in storage_options key/secret, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE and ~/.aws/credentials, SSO, then the instance or container role",
            **where,
        )
    if isinstance(e, NoAnswer):
        return BackendError(no_answer_message(e, endpoint, target, action), **where)
    inner = cause(e)
    if isinstance(inner, Stalled):
        return BackendError(
            f"every attempt to {action} {target} at {endpoint} stalled, the last one {inner}, "
            "until the retries ran out (retry_timeout); check the network and the server, or "
            "raise stall_timeout if the link is this slow",
            retryable=True,
            **where,
        )
    if isinstance(inner, Cancelled):
        return BackendError(f"cannot {action} {target}: cancelled ({inner})", **where)
    if isinstance(e, (BotoConnectionError, HTTPClientError, ResponseStreamingError)):
        return BackendError(
            f"cannot reach the S3 endpoint {endpoint} to {action} {target} "
            f"({type(e).__name__}, after retries); check endpoint_url / AWS_ENDPOINT_URL, "
            "the network, and that the server is up",
            retryable=True,
            **where,
        )
    kind = "BotoCoreError" if isinstance(e, BotoCoreError) else type(e).__name__
    return BackendError(f"cannot {action} {target}: {kind}: {e}", **where)


def no_answer_message(e: NoAnswer, endpoint: str, target: str, action: str) -> str:
    """What a mute endpoint's NoAnswer says: the endpoint, what it did not do, the option."""
    within = f"within {e.seconds:g} s (first_byte_timeout)"
    if e.accepted is False:
        what = f"{endpoint} accepted no connection {within}"
    elif e.accepted:
        what = f"{endpoint} accepted the connection but sent no answer {within}"
    else:
        what = f"{endpoint} sent no answer {within}"
    last = f" (last error: {e.last_error})" if e.last_error else ""
    return (
        f"{what}, to {action} {target}{last}; check endpoint_url / AWS_ENDPOINT_URL and the "
        "server, or raise storage_options first_byte_timeout (-o first_byte_timeout=SECONDS) "
        "if it is this slow to answer"
    )


def error_for(
    code: str,
    status: int,
    *,
    bucket: str,
    endpoint: str,
    target: str,
    action: str,
    message: str = "",
    store_uri: str | None = None,
) -> CheckpointError:
    """Our error for an S3 error code and HTTP status (``0`` when there is none)."""
    detail = f" ({code}: {message})" if message else f" ({code})" if code else ""
    where = context(target, store_uri)
    if code == "NoSuchBucket":  # not NotFoundError: a typo in a bucket name is no empty store
        return BackendError(
            f"bucket {bucket!r} does not exist at {endpoint} (while trying to {action} "
            f"{target}); create it (`aws s3 mb s3://{bucket}`, with --endpoint-url for "
            "S3-compatible servers, or in terraform) or fix the URI",
            **where,
        )
    if code in NOT_FOUND or status == 404:
        return NotFoundError(f"{target} does not exist (while trying to {action} it)", **where)
    if code in EXPIRED:
        return AccessDeniedError(
            f"{target}: the server refused the AWS credentials as expired ({code}) while "
            f"trying to {action} it, and renewing them from their source did not help: check "
            "the credential source (the profile's credential_process or role, the web "
            "identity token file, the container endpoint) and this machine's clock; static "
            "keys (storage options key/secret/token, AWS_ACCESS_KEY_ID) cannot be renewed",
            **where,
        )
    if code in DENIED or status == 403:
        return AccessDeniedError(
            f"access denied to {action} {target}{detail}: check the credentials boto3 uses "
            "(AWS_PROFILE, AWS_ACCESS_KEY_ID, an expired session token) and that the IAM or "
            "bucket policy allows this on the bucket and prefix",
            **where,
        )
    if code in CONFLICT or status in (409, 412):
        return PreconditionFailedError(
            f"a condition on {target} failed ({action}){detail}", **where
        )
    if code in RETRYABLE or status >= 500:
        return BackendError(
            f"{endpoint} failed to {action} {target}{detail}, after retries; try again later",
            retryable=True,
            **where,
        )
    if code == "InvalidBucketName":
        return ConfigError(f"{target}: the server rejects the bucket name{detail}", **where)
    return BackendError(f"cannot {action} {target}{detail} (HTTP {status})", **where)


@dataclass(frozen=True)
class Translator:
    """The translation for one backend, which names its bucket and endpoint in messages.

    With ``store_uri`` (the backend's ``s3://bucket/prefix``), errors about an object also carry
    its store-relative ``path``; without it, only its ``uri`` (:func:`context`).
    """

    bucket: str
    endpoint: str
    store_uri: str | None = None

    @contextlib.contextmanager
    def translated(self, target: str, action: str) -> Iterator[None]:
        """Raise our error, chained, for a botocore one raised inside."""
        try:
            yield
        except DeadlineExceededError as e:
            e.add_context(**context(target, self.store_uri))
            raise
        except (ClientError, BotoCoreError) as e:
            raise translate(
                e,
                bucket=self.bucket,
                endpoint=self.endpoint,
                target=target,
                action=action,
                store_uri=self.store_uri,
            ) from e

    def error(self, code: str, target: str, action: str, message: str = "") -> CheckpointError:
        """Our error for an S3 error code that came without an exception."""
        return error_for(
            code,
            0,
            bucket=self.bucket,
            endpoint=self.endpoint,
            target=target,
            action=action,
            message=message,
            store_uri=self.store_uri,
        )
