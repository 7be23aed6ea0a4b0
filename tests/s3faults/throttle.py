"""S3's request-rate limit, modelled: token buckets per key prefix, for the fault proxy.

S3 accepts about 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second per
partitioned prefix and answers ``503 SlowDown`` beyond; a new prefix shares its parent's
partition until S3 splits it, which takes minutes of sustained load. A save of 1,024 ranks writes
one fresh ``global_step_N/`` directory, so the model that matters for it is the worst case: every
request under one prefix draws from one bucket of tokens.

Why a model at all: the client's answer to throttling (botocore's backoff, its retry quota, our
concurrency) is what a test must exercise, and moto never throttles. The rates are S3's scaled
down by :data:`DEFAULT_SCALE`, so that a small machine, which drives a few hundred requests per
second through moto, still meets the limit rather than its own CPU.

A prefix is the bucket and the first ``prefix_depth`` segments of the key (``/``-separated):
``prefix_depth=1`` with a store at ``s3://bucket/run`` puts a whole store in one partition. Each
bucket holds ``burst`` seconds' worth of tokens (S3 absorbs short bursts) and refills at the
rate. The clock is an argument, so tests drive the buckets with a fake one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

S3_WRITE_RATE = 3500.0
"""PUT/COPY/POST/DELETE requests per second per partitioned prefix on AWS S3."""
S3_READ_RATE = 5500.0
"""GET/HEAD requests per second per partitioned prefix on AWS S3 (LIST counts as a GET)."""
DEFAULT_SCALE = 50.0
"""S3's rates divided by this: 70 writes and 110 reads per second per prefix, below what a
two-core machine drives through moto, so the limit binds before the CPU does."""
WRITES = frozenset(
    [
        "PutObject",
        "CopyObject",
        "UploadPart",
        "UploadPartCopy",
        "CreateMultipartUpload",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "DeleteObject",
        "DeleteObjects",
    ]
)
"""Operations (as :func:`~s3faults.faultproxy.operation` names them) that draw from
the write bucket; every other one draws from the read bucket."""


@dataclass
class TokenBucket:
    """``rate`` tokens a second, at most ``capacity`` saved up; starts full."""

    rate: float
    capacity: float
    tokens: float = field(init=False)
    updated: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.capacity < 1:
            raise ValueError(
                f"a token bucket needs rate > 0 and capacity >= 1, got {self.rate}, {self.capacity}"
            )
        self.tokens = self.capacity

    def take(self, now: float) -> bool:
        """Spend one token if there is one (refilling first for the time since last asked)."""
        if self.updated is not None:
            elapsed = max(0.0, now - self.updated)
            self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Throttle:
    """Admits or refuses requests, one write and one read bucket per prefix.

    ``throttled`` counts refusals by operation; ``admitted`` counts what passed.
    """

    def __init__(
        self,
        *,
        write_rate: float = S3_WRITE_RATE / DEFAULT_SCALE,
        read_rate: float = S3_READ_RATE / DEFAULT_SCALE,
        burst: float = 1.0,
        prefix_depth: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if write_rate <= 0 or read_rate <= 0:
            raise ValueError(f"rates must be positive, got {write_rate!r} and {read_rate!r}")
        if burst <= 0:
            raise ValueError(f"burst must be a positive number of seconds, got {burst!r}")
        if prefix_depth < 0:
            raise ValueError(f"prefix_depth must be 0 or more, got {prefix_depth!r}")
        self.write_rate = write_rate
        self.read_rate = read_rate
        self.burst = burst
        self.prefix_depth = prefix_depth
        self.clock = clock
        self.throttled: Counter[str] = Counter()
        self.admitted: Counter[str] = Counter()
        self._buckets: dict[tuple[str, bool], TokenBucket] = {}
        self._lock = threading.Lock()

    @classmethod
    def scaled(
        cls,
        scale: float = DEFAULT_SCALE,
        *,
        burst: float = 1.0,
        prefix_depth: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> Throttle:
        """S3's rates divided by ``scale`` (the other options as for the constructor)."""
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale!r}")
        return cls(
            write_rate=S3_WRITE_RATE / scale,
            read_rate=S3_READ_RATE / scale,
            burst=burst,
            prefix_depth=prefix_depth,
            clock=clock,
        )

    def prefix(self, path: str) -> str:
        """The partition of a path-style request path (``/bucket/key``)."""
        bucket, _, key = path.lstrip("/").partition("/")
        segments = key.split("/")[: self.prefix_depth] if self.prefix_depth else []
        return "/".join([bucket, *segments])

    def admit(self, op: str, path: str) -> bool:
        """Whether a request of ``op`` on ``path`` fits its prefix's rate now."""
        write = op in WRITES
        key = (self.prefix(path), write)
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                rate = self.write_rate if write else self.read_rate
                bucket = self._buckets[key] = TokenBucket(rate, max(1.0, rate * self.burst))
            ok = bucket.take(self.clock())
            (self.admitted if ok else self.throttled)[op] += 1
            return ok

    def lower_bound(self, writes: int, reads: int) -> float:
        """The fewest seconds ``writes`` and ``reads`` requests to one prefix can take, past
        the first burst (the buckets run side by side)."""
        spare_w, spare_r = self.write_rate * self.burst, self.read_rate * self.burst
        return max(
            max(0.0, writes - spare_w) / self.write_rate, max(0.0, reads - spare_r) / self.read_rate
        )
