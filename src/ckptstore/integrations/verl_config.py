"""The verl trainer config, read once: our ``trainer.ckptstore`` section and the verl keys the
integration depends on, validated up front so a typo fails at start with the key's name rather
than hours later at the first save.

Works on OmegaConf ``DictConfig`` (what verl passes) and on plain nested dicts alike: only item
access and ``Mapping`` are used, so reading the config needs neither omegaconf nor verl.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.options import VERL, StoreOptions
from ckptstore.store import CheckpointStore
from ckptstore.tiers.local import PersistPolicy

SECTION = "trainer.ckptstore"
UPLOAD_MODES = ("auto", "driver", "per_node")


STORE_KEYS = (
    "keep_last",
    "keep_every",
    "keep_best",
    "best_metric",
    "best_mode",
    "keep_every_seconds",
    "storage_options",
    "compat",
    "incremental",
    "lease",
    "takeover",
    "lease_ttl",
    "save_timeout",
    "load_timeout",
    "local",
    "local_keep_last",
    "persist_interval_seconds",
)
"""The :class:`~ckptstore.options.StoreOptions` a verl config may set (policy objects and the
signing key stay out of YAML: set the key in the environment)."""
VERL_KEYS = ("uri", "resume", "upload", "prune_local", "persist_every", "max_failed_saves")


@dataclass(frozen=True)
class VerlStoreConfig:
    """The ``trainer.ckptstore`` section of a verl config (see docs/verl.md for an example):
    the integration's own keys, and the store's options (``settings.keep_last`` reads them)."""

    uri: str
    options: StoreOptions = field(default_factory=StoreOptions)
    """The store's options, validated by the store's own rules, named as verl's keys."""
    resume: bool = True
    """Pull from the store before verl loads; False leaves resuming to verl alone."""
    upload: str = "auto"
    """``driver`` (one node or shared storage), ``per_node`` (each node uploads its own files)
    or ``auto``: per node when Ray runs on more than one node."""
    prune_local: bool = True
    """Delete local step directories beyond ``max_actor_ckpt_to_keep`` once committed."""
    persist_every: int | None = None
    """Commit every this many verl saves to the store (and the last step of training); the
    others stay in ``trainer.default_local_dir``, verl's own local tier. With ``local`` (a
    local tier of the store on every node), every save commits there and this is the store's
    own ``persist_every``: the due steps reach the store in the background (tiers/local.py)."""
    max_failed_saves: int = 3
    """A commit that fails is logged and training goes on; this many in a row raise."""

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.strip():
            raise ConfigError(
                f"{SECTION}.uri must name the store (like s3://bucket/run), got {self.uri!r}"
            )
        for name in ("resume", "prune_local"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{SECTION}.{name} must be true or false, got {getattr(self, name)!r}",
                    uri=self.uri,
                )
        self.persist_policy  # noqa: B018 - validates persist_every, naming it as verl's key
        failed = self.max_failed_saves
        if isinstance(failed, bool) or not isinstance(failed, int) or failed < 1:
            raise ConfigError(
                f"{SECTION}.max_failed_saves must be a positive integer, got {failed!r}",
                uri=self.uri,
            )
        if self.upload not in UPLOAD_MODES:
            raise ConfigError(
                f"{SECTION}.upload must be one of {', '.join(UPLOAD_MODES)}, got {self.upload!r}",
                uri=self.uri,
            )

    @property
    def persist_policy(self) -> PersistPolicy:
        """When a verl save is committed to the store (tiers/local.py)."""
        return PersistPolicy(self.persist_every, spelling=VERL)

    def __getattr__(self, name: str) -> Any:
        if name in STORE_KEYS:  # settings.keep_last: the store option of that name
            return getattr(self.options, name)
        raise AttributeError(name)

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
        known = [*VERL_KEYS, *STORE_KEYS]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown key(s) in {SECTION}: {', '.join(unknown)}; known keys: {', '.join(known)}"
            )
        if "uri" not in values:
            raise ConfigError(f"{SECTION}.uri is required: the store's URI, like s3://bucket/run")
        stored = {k: v for k, v in values.items() if k in STORE_KEYS}
        if "local" in stored and "persist_every" in values:  # the store's tiers decide
            stored["persist_every"] = values.pop("persist_every")
        try:
            options = StoreOptions.from_mapping(stored, spelling=VERL)
        except ConfigError as e:
            raise e.add_context(uri=values["uri"]) from None
        return cls(options=options, **{k: v for k, v in values.items() if k in VERL_KEYS})

    def open(self) -> CheckpointStore:
        """The store with every option of the section."""
        return CheckpointStore(self.uri, options=self.options)


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


def _plain(value: Any) -> Any:
    """OmegaConf containers (or any mappings and lists) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value
