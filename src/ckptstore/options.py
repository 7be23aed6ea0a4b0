"""A store's options, validated once, whoever gives them.

``CheckpointStore(uri, keep_last=3, ...)``, the command line (``--keep-last 3``) and verl's
config (``trainer.ckptstore.keep_last=3``) all build one :class:`StoreOptions`; it checks every
value and every rule between values when it is made, naming each option the way its face
spells it (:data:`PYTHON`, :data:`CLI`, :data:`VERL`), so a typo fails at start with the name
the user typed. The store, the CLI and the verl integration read the result and check nothing
again.

A name that is no option is refused with the closest one (``keep_lst``: did you mean
``keep_last``?); a storage option of the S3 backend given beside the store's options
(``stall_timeout=1``) is refused with where it goes (``storage_options={"stall_timeout": 1}``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field, fields
from typing import Any

from ckptstore.domain import layout
from ckptstore.domain.compat import COMPAT_MODES
from ckptstore.domain.retention import Policy, RetentionPolicy, as_policies
from ckptstore.errors import ConfigError
from ckptstore.protocol.lease import DEFAULT_TTL
from ckptstore.tiers.local import PersistPolicy

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
    """The backend's own options (S3: ``endpoint_url``, ``part_size``, ``stall_timeout``, ...);
    ``None`` is none, as in fsspec."""
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
    """A local tier in front of the store: a path on fast local disk (tiers/local.py)."""
    local_keep_last: int | None = None
    """Steps the local tier keeps (default 2), besides those not yet durable."""
    persist_every: int | None = None
    """Copy every this many saves to the store (default: every save)."""
    persist_interval_seconds: float | None = None
    """Copy a save to the store once this many seconds passed since the last copy."""
    replicas: int = 0
    """Copies of each rank's local files kept in the local tier of a rank on another node
    (``save_distributed``), so a lost node resumes from its peers, not the bucket (peers.py)."""
    spelling: InitVar[Spelling | None] = None
    """How errors name an option (default :data:`PYTHON`). Not a function as the default:
    ``dataclasses.replace`` reads an init-only field off the instance, where a function
    default would come back as a bound method."""

    def __post_init__(self, spelling: Spelling | None) -> None:
        name = spelling or PYTHON
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
        if self.storage_options is None:  # fsspec's and every caller's "no options"
            object.__setattr__(self, "storage_options", {})
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
            raise ConfigError(
                f"{name('shard_size')} must be a number of bytes, got {self.shard_size!r}"
            )
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
        """When a local step is due for the store (tiers/local.py)."""
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
        refuse_unknown(values, cls.names(), spelling=spelling)
        return cls(**values, spelling=spelling)

    @classmethod
    def from_call(
        cls,
        function: Callable[..., Any],
        arguments: Mapping[str, Any],
        options: StoreOptions | None = None,
    ) -> StoreOptions:
        """The options a call of ``function`` (``CheckpointStore.__init__``) was given.

        ``function`` has one keyword-only parameter per field, so IDEs and type checkers see
        every option, and a ``**`` parameter that only catches names that are no option, to
        refuse them here (the closest known name suggested). ``arguments`` are its
        ``locals()`` at entry: every field is read from there by its name, so a field the
        signature lacks fails every call at once, never silently. ``options``, an object
        given whole, is returned as it is, unless a keyword option was given too (refused).
        """
        parameters = _parameters(function)
        missing = [name for name in cls.names() if name not in parameters]
        if missing:  # a new field, not added to the signature: a bug of ours, not the caller's
            raise TypeError(
                f"{function.__qualname__} lacks a keyword parameter for StoreOptions' "
                f"{', '.join(missing)}"
            )
        rest = [p.name for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        extra: Mapping[str, Any] = arguments[rest[0]] if rest else {}
        if extra:
            known = [
                p.name for p in parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
            ]
            refuse_unknown(extra, known, spelling=PYTHON)
        given = {name: arguments[name] for name in cls.names()}
        if options is None:
            return cls(**given)
        both = sorted(n for n, v in given.items() if not _same(v, parameters[n].default))
        if both:
            raise ConfigError(f"pass options= or keyword options, not both (got {both})")
        return options


@functools.cache
def _parameters(function: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(function).parameters


def storage_option_names() -> frozenset[str]:
    """The storage options the S3 backend reads (``s3_options.OPTIONS``; none without boto3)."""
    try:
        from ckptstore.backends.s3_options import OPTIONS
    except ImportError:
        return frozenset()
    return OPTIONS


def refuse_unknown(values: Mapping[str, Any], known: Iterable[str], *, spelling: Spelling) -> None:
    """ConfigError for the names of ``values`` not in ``known``: a storage option with where
    it goes instead, any other with the closest known name (or the storage option it was
    probably meant to be), each spelled the way the user's face spells it."""
    known = list(known)
    unknown = sorted(set(values) - set(known))
    if not unknown:
        return
    storage = storage_option_names()
    misplaced = {name: values[name] for name in unknown if name in storage}
    messages = []
    if misplaced:
        one = len(misplaced) == 1
        messages.append(
            f"{', '.join(misplaced)} {'is a storage option' if one else 'are storage options'} "
            f"of the S3 backend, not {'a store option' if one else 'store options'}: "
            f"{_storage_fix(misplaced, spelling)}"
        )
    unlisted = []
    for name in unknown:
        if name in misplaced:
            continue
        close = difflib.get_close_matches(name, [*known, *sorted(storage)], n=1)
        if not close:
            unlisted.append(spelling(name))
        elif close[0] in known:
            messages.append(f"unknown option {spelling(name)}; did you mean {spelling(close[0])}?")
        else:
            messages.append(
                f"unknown option {spelling(name)}; did you mean the storage option {close[0]} "
                f"({_storage_fix({close[0]: values[name]}, spelling)})?"
            )
    if unlisted:
        messages.append(
            f"unknown option{'s' if len(unlisted) > 1 else ''} {', '.join(unlisted)}; known "
            f"options: {', '.join(map(spelling, known))}"
        )
    text = messages[0]
    for message in messages[1:]:
        text += (" " if text.endswith("?") else ". ") + message
    raise ConfigError(text)


def _storage_fix(values: Mapping[str, Any], spelling: Spelling) -> str:
    """How to give storage options on the face ``spelling`` names; values that are numbers or
    flags are shown, any other as ``...`` (a message never shows a credential)."""
    python = spelling is PYTHON
    shown = {name: _shown(value, python=python) for name, value in values.items()}
    if python:
        return "pass storage_options={" + ", ".join(f'"{k}": {v}' for k, v in shown.items()) + "}"
    if spelling is CLI:
        return "pass " + " ".join(f"-o {k}={v}" for k, v in shown.items())
    return "set " + ", ".join(f"{spelling('storage_options')}.{k}={v}" for k, v in shown.items())


def _shown(value: object, *, python: bool) -> str:
    """``1``, ``2.5``, ``True`` (``true`` in a config or on the command line), else ``...``."""
    if isinstance(value, (bool, int, float)):
        return repr(value) if python else json.dumps(value)
    return "..."


def _same(value: object, default: object) -> bool:
    """Whether a keyword was left at its default (or given the same value)."""
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # an __eq__ that raises or returns an array: not the default
        return False


def _positive(value: object) -> bool:
    """A positive int or float (infinity included), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
