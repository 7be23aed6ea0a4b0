"""Storage options and URIs of the S3 backend: parsed and validated once, at construction.

Everything the user did not set is left out, so boto3 still resolves it the usual way
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``AWS_REGION``, the credential chain). Credentials are
kept out of ``repr`` and out of every message: a message names an option, never its value.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ProfileNotFound

from ckptstore.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
MAX_SINGLE_PUT = 5 * GiB
"""The largest object one PutObject or CopyObject may create."""
DEFAULT_PART_SIZE = 32 * MiB
"""Equal to the default shard size of a save (``layout.DEFAULT_SHARD_SIZE``, which a test holds
this to), so most shards go up in one PutObject: fewer requests than a multipart upload and, on
servers that rewrite an object when its upload completes (moto), about half the server's work.
Side by side on moto (256 MiB state), 16 MiB parts saved 0.8x as fast."""
MAX_TAIL = 1 * MiB
"""The most bytes a last part (or read range) may run past ``part_size``: see :func:`tail`."""
DEFAULT_STALL_TIMEOUT = 60.0
"""Seconds a request may move (almost) no bytes before it is aborted and retried: long enough
for a loaded server's first byte, short against a save's deadline."""
DEFAULT_RETRY_TIMEOUT = 300.0
"""Seconds one request keeps retrying transient errors (SlowDown, 5xx, resets, stalls) when
no deadline is in force; a deadline cuts it shorter."""
CONNECT_TIMEOUT = 10.0
"""botocore's connect timeout, lowered to ``stall_timeout`` when that is shorter."""
DEFAULT_FIRST_BYTE_TIMEOUT = 15.0
"""Seconds an endpoint that has not answered this process yet gets to answer a request (to
accept its connection and send the first byte of an answer), its retries included: a wrong
``endpoint_url`` that accepts connections and never answers fails in seconds, not after
``retry_timeout`` (:mod:`.s3_retry`). Long enough for a loaded server's first answer."""

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
ALIASES = {
    "region_name": "region",
    "aws_access_key_id": "key",
    "aws_secret_access_key": "secret",
    "aws_session_token": "token",
}
OPTIONS = frozenset(
    [
        "endpoint_url",
        "region",
        "profile",
        "key",
        "secret",
        "token",
        "addressing_style",
        "client_kwargs",
        "config_kwargs",
        "part_size",
        "max_concurrency",
        "multipart_threshold",
        "max_attempts",
        "retry_timeout",
        "stall_timeout",
        "first_byte_timeout",
        "checksums",
    ]
) | frozenset(ALIASES)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``(bucket, prefix)``; anything malformed is a ConfigError."""
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        raise ConfigError(
            f"store URI {uri!r} is malformed: expected s3://bucket/prefix", uri=uri
        ) from e
    if parts.scheme.lower() not in ("s3", "s3a"):
        raise ConfigError(f"store URI {uri!r} is not an s3:// URI", uri=uri)
    if "@" in parts.netloc:  # do not echo the URI (not even as e.uri): it holds a secret
        raise ConfigError(
            "s3:// store URIs must not contain credentials; pass them through AWS_PROFILE, "
            "the AWS_* environment variables or storage_options key/secret"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"store URI {uri!r} must not contain '?' or '#'", uri=uri)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not bucket:
        raise ConfigError(
            f"store URI {uri!r} names no bucket: expected s3://bucket/prefix", uri=uri
        )
    if not _BUCKET_RE.match(bucket) or ".." in bucket or _is_ip(bucket):
        raise ConfigError(
            f"{bucket!r} in {uri!r} is not a valid S3 bucket name: 3-63 lowercase letters, "
            "digits, '.' and '-', starting and ending with a letter or digit",
            uri=uri,
        )
    if "//" in prefix:
        raise ConfigError(f"store URI {uri!r} has an empty path segment ('//')", uri=uri)
    return bucket, prefix


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def tail(part_size: int) -> int:
    """How far past ``part_size`` a file's last part (upload) or range (download) may run,
    rather than leave a short one of its own: :data:`MAX_TAIL`, or an eighth of a small part.

    A shard is its tensors' budget, ``DEFAULT_SHARD_SIZE`` = ``DEFAULT_PART_SIZE``, plus a
    header of a few KiB. Cut at exactly ``part_size``, each shard went up as a multipart upload
    (two parts, a completion that moto answers by rewriting the object) and came back as two
    GETs (a ranged GET that moto answers by reading the whole object): about twice the
    server's work per shard, for a few KiB.
    """
    return min(MAX_TAIL, part_size // 8)


@dataclass(frozen=True)
class S3Options:
    """Validated storage options; the client settings stay out of ``repr`` (they hold secrets)."""

    part_size: int = DEFAULT_PART_SIZE
    max_concurrency: int = 8
    multipart_threshold: int = DEFAULT_PART_SIZE
    max_attempts: int | None = None
    """Attempts per request at most (``None``: bounded by time only, ``retry_timeout``)."""
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT
    """Seconds an endpoint that never answered this process gets to answer (connection and
    first byte, retries included) before a request to it fails for good."""
    checksums: bool = True
    session_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    client_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    config: Config | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, uri: str, options: Mapping[str, Any]) -> S3Options:
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise ConfigError(
                f"{uri}: unknown storage option(s) {unknown}; valid ones are {sorted(OPTIONS)}",
                uri=uri,
            )
        opts: dict[str, Any] = {}
        for name, value in options.items():
            canonical = ALIASES.get(name, name)
            if canonical in opts:
                raise ConfigError(
                    f"{uri}: storage option {canonical!r} is given twice ({name!r})", uri=uri
                )
            opts[canonical] = value
        part_size = _int(uri, opts, "part_size", DEFAULT_PART_SIZE, MIN_PART_SIZE, MAX_PART_SIZE)
        threshold = _int(uri, opts, "multipart_threshold", part_size, 1, MAX_SINGLE_PUT)
        concurrency = _int(uri, opts, "max_concurrency", 8, 1, 256)
        attempts = None
        if opts.get("max_attempts") is not None:
            attempts = _int(uri, opts, "max_attempts", 1, 1, 1000)
        stall = _seconds(uri, opts, "stall_timeout", DEFAULT_STALL_TIMEOUT, 0.05, 3600.0)
        budget = _seconds(uri, opts, "retry_timeout", DEFAULT_RETRY_TIMEOUT, 0.0, 86400.0)
        first_byte = _seconds(
            uri, opts, "first_byte_timeout", DEFAULT_FIRST_BYTE_TIMEOUT, 0.05, 3600.0
        )
        checksums = opts.get("checksums", True)
        if not isinstance(checksums, bool):
            raise ConfigError(f"{uri}: storage option 'checksums' must be True or False", uri=uri)
        session = {
            target: _str(uri, opts, name)
            for name, target in (
                ("profile", "profile_name"),
                ("key", "aws_access_key_id"),
                ("secret", "aws_secret_access_key"),
                ("token", "aws_session_token"),
                ("region", "region_name"),
            )
            if opts.get(name) is not None
        }
        client = dict(_dict(uri, opts, "client_kwargs"))
        if opts.get("endpoint_url") is not None:
            if client.get("endpoint_url", opts["endpoint_url"]) != opts["endpoint_url"]:
                raise ConfigError(
                    f"{uri}: endpoint_url is given twice with different values", uri=uri
                )
            client["endpoint_url"] = _str(uri, opts, "endpoint_url")
        return cls(
            part_size=part_size,
            max_concurrency=concurrency,
            multipart_threshold=threshold,
            max_attempts=attempts,
            retry_timeout=budget,
            stall_timeout=stall,
            first_byte_timeout=first_byte,
            checksums=checksums,
            session_kwargs=session,
            client_kwargs=client,
            config=_config(uri, opts, concurrency, stall),
        )

    def copy_domain(self, endpoint: str) -> str:
        """Who can copy between two backends server-side: one ``endpoint`` (the client's
        resolved URL, region included on AWS) reached with the same credential settings. A
        digest, so no secret shows where it is compared; settings left to boto3's chain
        (environment, profile, role) compare equal, as both clients resolve them alike."""
        settings = json.dumps(
            [endpoint, sorted(self.session_kwargs.items())], default=str, sort_keys=True
        )
        return "s3:" + hashlib.sha256(settings.encode()).hexdigest()[:24]

    def client(self, uri: str) -> Any:
        """A boto3 S3 client; boto3 resolves whatever was not set (env vars, profiles, roles)."""
        try:
            session = boto3.session.Session(botocore_session=_core_session(), **self.session_kwargs)
            return session.client("s3", config=self.config, **self.client_kwargs)
        except ProfileNotFound as e:
            name = e.kwargs.get("profile") or self.session_kwargs.get("profile_name")
            raise ConfigError(
                f"{uri}: AWS profile {name!r} is not in ~/.aws/config or ~/.aws/credentials "
                "(or the files AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE name); create it "
                f"with `aws configure --profile {name}`, or pass a profile that exists "
                "(profile / --profile, AWS_PROFILE)",
                uri=uri,
            ) from e
        except (BotoCoreError, TypeError, ValueError) as e:
            raise ConfigError(f"{uri}: cannot create an S3 client: {e}", uri=uri) from e


_LOADERS: dict[tuple[str, ...], Any] = {}
_LOADERS_LOCK = threading.Lock()


def _core_session() -> botocore.session.Session:
    """A new botocore session whose data loader (the JSON service models and endpoint rules,
    parsed once and cached on the loader) is shared with every session that searches the same
    data paths: each new session parsing them again cost about as much CPU as a save of a
    small step, for every backend a process opens."""
    core = botocore.session.get_session()
    loader = core.get_component("data_loader")
    with _LOADERS_LOCK:
        shared = _LOADERS.setdefault(tuple(loader.search_paths), loader)
    core.register_component("data_loader", shared)
    return core


def _int(uri: str, opts: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = opts.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(
            f"{uri}: storage option {name!r} must be an integer from {low} to {high}, "
            f"got {value!r}",
            uri=uri,
        )
    return value


def _seconds(
    uri: str, opts: dict[str, Any], name: str, default: float, low: float, high: float
) -> float:
    value = opts.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(
            f"{uri}: storage option {name!r} must be a number of seconds from {low:g} to "
            f"{high:g}, got {value!r}",
            uri=uri,
        )
    return float(value)


def _str(uri: str, opts: dict[str, Any], name: str) -> str:
    value = opts[name]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{uri}: storage option {name!r} must be a non-empty string", uri=uri)
    return value


def _dict(uri: str, opts: dict[str, Any], name: str) -> dict[str, Any]:
    value = opts.get(name) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{uri}: storage option {name!r} must be a dict", uri=uri)
    return dict(value)


def _config(uri: str, opts: dict[str, Any], concurrency: int, stall: float) -> Config:
    """Our defaults (retries, timeouts, pool size), then the user's ``config_kwargs`` on top.

    botocore does not retry (one attempt): retries live in one place, :mod:`.s3_retry`, which
    budgets them by time, shares a send rate between the threads of a process and never waits
    past a deadline. Its socket timeouts are the stall timeout, so no single read or write on
    a socket blocks longer than that (a trickle is the watchdog's: :mod:`.s3_progress`)."""
    s3: dict[str, Any] = {}
    style = opts.get("addressing_style")
    if style is not None:
        if style not in ("path", "virtual", "auto"):
            raise ConfigError(
                f"{uri}: addressing_style must be 'path', 'virtual' or 'auto', got {style!r}",
                uri=uri,
            )
        s3["addressing_style"] = style
    user = _dict(uri, opts, "config_kwargs")
    s3.update(user.pop("s3", None) or {})
    try:
        base = Config(
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=min(CONNECT_TIMEOUT, stall),
            read_timeout=stall,
            max_pool_connections=max(10, 2 * concurrency + 2),
            **({"s3": s3} if s3 else {}),
        )
        return base.merge(Config(**user))
    except TypeError as e:
        raise ConfigError(f"{uri}: invalid config_kwargs for botocore Config: {e}", uri=uri) from e
