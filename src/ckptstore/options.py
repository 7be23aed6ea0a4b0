"""A store's options, validated once, whoever gives them.

``CheckpointStore(uri, keep_last=3, ...)``, the command line (``--keep-last 3``) and verl's
config (``trainer.ckptstore.keep_last=3``) all build one :class:`StoreOptions`; it checks every
value and every rule between values when it is made, naming each option the way its face
spells it (:data:`PYTHON`, :data:`CLI`, :data:`VERL`), so a typo fails at start with the name
the user typed. The store, the CLI and the verl integration read the result and check nothing
again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field, fields
from typing import Any

from ckptstore import layout
from ckptstore.compat import COMPAT_MODES
from ckptstore.errors import ConfigError
from ckptstore.lease import DEFAULT_TTL
from ckptstore.retention import Policy, RetentionPolicy, as_policies
from ckptstore.tiers import PersistPolicy

Spelling = Callable[[str], str]


def PYTHON(name: str) -> str:
    """``keep_last``: a keyword argument of ``CheckpointStore``."""
    return name


def CLI(name: str) -> str:
    """``--keep-last``: a command-line option."""
    return "--" + name.replace("_", "-")


def VERL(name: str) -> str:
    """``trainer.ckptstore.keep_last``: a key of verl's trainer config."""
    return f"trainer.ckptstore.{name}"


@dataclass(frozen=True)
class StoreOptions:
    """Everything a store can be opened with, besides its URI and injected parts."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str | None = None
    keep_every_seconds: float | None = None
    retention: Policy | Sequence[Policy] | None = None
    """Retention policy objects of your own (retention.py), kept by union with the rest."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    compat: str = "warn"
    shard_size: int = layout.DEFAULT_SHARD_SIZE
    incremental: bool = True
    lease: bool = True
    takeover: bool = False
    lease_ttl: float = DEFAULT_TTL
    signing_key: bytes | str | None = None
    save_timeout: float | None = None
    """Seconds a save may take before it fails with SaveTimeoutError (None: no deadline)."""
    load_timeout: float | None = None
    """Seconds a load or pull may take before it fails with LoadTimeoutError."""
    local: str | None = None
    """A local tier in front of the store: a path on fast local disk (tiers.py)."""
    local_keep_last: int | None = None
    """Steps the local tier keeps (default 2), besides those not yet durable."""
    persist_every: int | None = None
    """Copy every this many saves to the store (default: every save)."""
    persist_interval_seconds: float | None = None
    """Copy a save to the store once this many seconds passed since the last copy."""
    replicas: int = 0
    """Copies of each rank's local files kept in the local tier of the next rank's node
    (``save_distributed``), so a lost node resumes from its peer, not the bucket (peers.py)."""
    spelling: InitVar[Spelling] = PYTHON

    def __post_init__(self, spelling: Spelling) -> None:
        name = spelling
        policy = RetentionPolicy(
            self.keep_last,
            self.keep_every,
            keep_best=self.keep_best,
            best_metric=self.best_metric,
            best_mode=self.best_mode,
            keep_every_seconds=self.keep_every_seconds,
            custom=as_policies(self.retention),
            spelling=name,
        )
        object.__setattr__(self, "_policy", policy)
        if not isinstance(self.storage_options, Mapping) or not all(
            isinstance(k, str) for k in self.storage_options
        ):
            raise ConfigError(
                f"{name('storage_options')} must be a mapping of option names to values, got "
                f"{self.storage_options!r}"
            )
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.compat not in COMPAT_MODES:
            raise ConfigError(
                f"{name('compat')} must be one of {', '.join(COMPAT_MODES)}, got {self.compat!r}"
            )
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int):
            raise ConfigError(f"{name('shard_size')} must be a number of bytes, got "
                              f"{self.shard_size!r}")  # fmt: skip
        if self.shard_size < 1:
            raise ConfigError(
                f"{name('shard_size')} must be a positive number of bytes, got {self.shard_size!r}"
            )
        for flag in ("incremental", "lease", "takeover"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    f"{name(flag)} must be true or false, got {getattr(self, flag)!r}"
                )
        if not _positive(self.lease_ttl):
            raise ConfigError(
                f"{name('lease_ttl')} must be a positive number of seconds (infinity: never "
                f"expires), got {self.lease_ttl!r}"
            )
        for timeout in ("save_timeout", "load_timeout"):
            seconds = getattr(self, timeout)
            if seconds is not None and not (_positive(seconds) and math.isfinite(seconds)):
                raise ConfigError(
                    f"{name(timeout)} must be a positive number of seconds (or None for no "
                    f"deadline), got {seconds!r}"
                )
        self._check_tiers(name)
        if self.signing_key is not None and not isinstance(self.signing_key, (bytes, str)):
            raise ConfigError(
                f"{name('signing_key')} must be bytes or text (hex), got "
                f"{type(self.signing_key).__name__}"
            )

    def _check_tiers(self, name: Spelling) -> None:
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas not in (0, 1):
            raise ConfigError(f"{name('replicas')} must be 0 or 1 (peer copies), got {replicas!r}")
        tiered = ("local_keep_last", "persist_every", "persist_interval_seconds")
        if self.local is None:
            given = [name(k) for k in tiered if getattr(self, k) is not None]
            given += [name("replicas")] if replicas else []
            if given:
                raise ConfigError(
                    f"{', '.join(given)} only apply with {name('local')}, the local tier in "
                    "front of the store (a path on fast local disk)"
                )
            return
        if not isinstance(self.local, str) or not self.local.strip():
            raise ConfigError(f"{name('local')} must be a path, got {self.local!r}")
        keep = self.local_keep_last
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"{name('local_keep_last')} must be a positive integer, got {keep!r}")
        PersistPolicy(self.persist_every, self.persist_interval_seconds, spelling=name)

    @property
    def persist_policy(self) -> PersistPolicy:
        """When a local step is due for the store (tiers.py)."""
        return PersistPolicy(self.persist_every, self.persist_interval_seconds)

    @property
    def policy(self) -> RetentionPolicy:
        """The retention rules, composed (retention.py)."""
        policy: RetentionPolicy = object.__getattribute__(self, "_policy")
        return policy

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, spelling: Spelling) -> StoreOptions:
        """From a face's key-value pairs (verl's section, say); unknown keys are refused by
        name, with the known ones listed."""
        known = cls.names()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(map(spelling, unknown))}; known: "
                f"{', '.join(map(spelling, known))}"
            )
        return cls(**values, spelling=spelling)


def _positive(value: object) -> bool:
    """A positive int or float (infinity included), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
