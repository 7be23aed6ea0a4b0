"""The verl trainer config, read once: our ``trainer.ckptstore`` section and the verl keys the
integration depends on, validated up front so a typo fails at start with the key's name rather
than hours later at the first save.

Works on OmegaConf ``DictConfig`` (what verl passes) and on plain nested dicts alike: only item
access and ``Mapping`` are used, so reading the config needs neither omegaconf nor verl.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ckptstore.errors import ConfigError
from ckptstore.lease import DEFAULT_TTL
from ckptstore.retention import BEST_MODES, RetentionPolicy
from ckptstore.store import CheckpointStore

SECTION = "trainer.ckptstore"
UPLOAD_MODES = ("auto", "driver", "per_node")


@dataclass(frozen=True)
class VerlStoreConfig:
    """The ``trainer.ckptstore`` section of a verl config (see docs/verl.md for an example)."""

    uri: str
    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    takeover: bool = False
    """Take the writer lease from a job that still holds it (a restart after preemption)."""
    resume: bool = True
    """Pull from the store before verl loads; False leaves resuming to verl alone."""
    upload: str = "auto"
    """``driver`` (one node or shared storage), ``per_node`` (each node uploads its own files)
    or ``auto``: per node when Ray runs on more than one node."""
    prune_local: bool = True
    """Delete local step directories beyond ``max_actor_ckpt_to_keep`` once committed."""
    keep_best: int | None = None
    """Also keep the N best steps by ``best_metric``, a number in each step's metadata."""
    best_metric: str | None = None
    best_mode: Literal["min", "max"] | None = None
    keep_every_seconds: float | None = None
    """Also keep one step per this many seconds of commit time."""
    lease_ttl: float = DEFAULT_TTL
    """Seconds before a dead driver's writer lease expires and a restart may take it."""

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.strip():
            raise ConfigError(
                f"{SECTION}.uri must name the store (like s3://bucket/run), got {self.uri!r}"
            )
        self._check_types()
        self._check_retention_and_lease()
        self._check_store_rules()

    def _check_types(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"{SECTION}.{name} must be a positive integer or null, got {value!r}",
                    uri=self.uri,
                )
        if not isinstance(self.storage_options, Mapping) or not all(
            isinstance(k, str) for k in self.storage_options
        ):
            raise ConfigError(
                f"{SECTION}.storage_options must be a mapping of option names to values",
                uri=self.uri,
            )
        for name in ("takeover", "resume", "prune_local"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{SECTION}.{name} must be true or false, got {getattr(self, name)!r}",
                    uri=self.uri,
                )
        if self.upload not in UPLOAD_MODES:
            raise ConfigError(
                f"{SECTION}.upload must be one of {', '.join(UPLOAD_MODES)}, got {self.upload!r}",
                uri=self.uri,
            )

    def _check_retention_and_lease(self) -> None:
        if self.best_metric is not None and (
            not isinstance(self.best_metric, str) or not self.best_metric
        ):
            raise ConfigError(
                f"{SECTION}.best_metric must be a metadata key (a non-empty string) or null, "
                f"got {self.best_metric!r}",
                uri=self.uri,
            )
        if self.best_mode is not None and self.best_mode not in BEST_MODES:
            raise ConfigError(
                f"{SECTION}.best_mode must be min (lower is better, a loss) or max (higher is "
                f"better, an accuracy), got {self.best_mode!r}",
                uri=self.uri,
            )
        seconds = self.keep_every_seconds
        if seconds is not None and not (_is_number(seconds) and math.isfinite(seconds)):
            raise ConfigError(
                f"{SECTION}.keep_every_seconds must be a positive number of seconds or null, "
                f"got {seconds!r}",
                uri=self.uri,
            )
        if not _is_number(self.lease_ttl):
            raise ConfigError(
                f"{SECTION}.lease_ttl must be a positive number of seconds (.inf: never "
                f"expires), got {self.lease_ttl!r}",
                uri=self.uri,
            )

    def _check_store_rules(self) -> None:
        """The rules between keys (keep_best needs best_metric and best_mode, ...) are the
        store's own: ask it now, at start, and name the section in its message."""
        try:
            RetentionPolicy(
                self.keep_last,
                self.keep_every,
                keep_best=self.keep_best,
                best_metric=self.best_metric,
                best_mode=self.best_mode,
                keep_every_seconds=self.keep_every_seconds,
            )
        except ConfigError as e:
            raise ConfigError(f"{SECTION}: {e}", uri=self.uri) from e

    @classmethod
    def from_verl(cls, config: Any) -> VerlStoreConfig:
        section = config_get(config, SECTION)
        if section is None:
            raise ConfigError(
                f"{SECTION} is not set; add at least `+{SECTION}.uri=s3://bucket/run` "
                "(see docs/verl.md)"
            )
        values = _plain(section)
        if not isinstance(values, dict):
            raise ConfigError(f"{SECTION} must be a mapping of keys to values, got {values!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown key(s) in {SECTION}: {', '.join(unknown)}; known keys: {', '.join(known)}"
            )
        if "uri" not in values:
            raise ConfigError(f"{SECTION}.uri is required: the store's URI, like s3://bucket/run")
        return cls(**values)

    def open(self) -> CheckpointStore:
        """The store with every retention rule and lease setting of the section."""
        return CheckpointStore(
            self.uri,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_metric=self.best_metric,
            best_mode=self.best_mode,
            keep_every_seconds=self.keep_every_seconds,
            storage_options=self.storage_options,
            takeover=self.takeover,
            lease_ttl=self.lease_ttl,
        )


@dataclass(frozen=True)
class VerlRun:
    """What the integration reads of verl's own ``trainer`` config."""

    local_dir: str
    """``trainer.default_local_dir``, made absolute the way verl's ``_load_checkpoint`` does."""
    resume_mode: str
    resume_from_path: str | None
    keep_local: int | None
    async_save: bool
    world_size: int | None
    names: Mapping[str, Any]

    @classmethod
    def from_verl(cls, config: Any) -> VerlRun:
        local_dir = config_get(config, "trainer.default_local_dir")
        if not isinstance(local_dir, str) or not local_dir:
            raise ConfigError("trainer.default_local_dir must be set: verl saves there first")

        def trainer(key: str, default: Any = None) -> Any:
            return config_get(config, f"trainer.{key}", default)

        keeps = [trainer(f"max_{role}_ckpt_to_keep") for role in ("actor", "critic")]
        keep = max(k for k in keeps if isinstance(k, int)) if isinstance(keeps[0], int) else None
        nodes, gpus = trainer("nnodes"), trainer("n_gpus_per_node")
        return cls(
            local_dir=os.path.abspath(local_dir),
            resume_mode=str(trainer("resume_mode", "auto")),
            resume_from_path=trainer("resume_from_path"),
            keep_local=keep if keep is not None and keep > 0 else None,
            async_save=any(
                bool(config_get(config, f"{role}.checkpoint.async_save", False))
                for role in ("actor_rollout_ref.actor", "critic")
            ),
            world_size=nodes * gpus if isinstance(nodes, int) and isinstance(gpus, int) else None,
            names={k: trainer(k) for k in ("project_name", "experiment_name")},
        )


def config_get(config: Any, path: str, default: Any = None) -> Any:
    """``config["a"]["b"]`` for ``path="a.b"``; ``default`` if a key is missing or null."""
    node = config
    for key in path.split("."):
        try:
            node = node[key]
        except (KeyError, AttributeError, TypeError, IndexError):
            return default
        if node is None:
            return default
    return node


def config_set(config: Any, path: str, value: Any) -> None:
    """Set ``path`` in place (verl's trainer holds the same config object)."""
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value


def _is_number(value: object) -> bool:
    """A positive int or float (YAML's ``.inf`` included), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _plain(value: Any) -> Any:
    """OmegaConf containers (or any mappings and lists) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value
