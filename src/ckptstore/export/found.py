"""What a step holds for an export, whatever wrote it: the tensors and the Hugging Face files.

Each source format (verl_source.py, dcp_source.py, native_source.py) returns a :class:`Found`;
hf.py turns it into the exported model. :func:`hf_files` is the one rule for which files of a
``huggingface/`` folder are copied: configs and tokenizer files, never weights (verl saves a
whole model there when asked to, which the export replaces).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ckptstore.errors import CorruptCheckpointError
from ckptstore.export.plan import Aliases, SourceTensor

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json", "*.ckpt", "*.h5")
"""Files of a ``huggingface/`` folder that hold weights, not configuration: not copied."""


@dataclass
class Found:
    """The tensors of a step in state order, under the step's own names, and its HF files."""

    kind: str
    """``verl``, ``dcp`` or ``native``."""
    tensors: list[SourceTensor]
    aliases: Aliases = field(default_factory=Aliases)
    hf_files: dict[str, str] = field(default_factory=dict)
    """Name in the exported directory -> path in the step."""
    world_size: int = 1
    lora_meta: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)
    """Entries that are not tensors (left out of the model)."""


def hf_files(paths: Iterable[str], folder: str) -> dict[str, str]:
    """The configuration and tokenizer files under ``folder/`` (name -> path in the step)."""
    prefix = f"{folder}/" if folder else ""
    found: dict[str, str] = {}
    for path in paths:
        if not path.startswith(prefix):
            continue
        name = path[len(prefix) :]
        if not any(fnmatchcase(name.rsplit("/", 1)[-1], p) for p in WEIGHT_FILES):
            found[name] = path
    return found


def json_object(data: bytes, where: str) -> dict[str, Any]:
    """A JSON object from a small file of the step, or a CorruptCheckpointError naming it."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})", uri=where) from e
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object", uri=where)
    return value


__all__ = ["WEIGHT_FILES", "Found", "hf_files", "json_object"]
