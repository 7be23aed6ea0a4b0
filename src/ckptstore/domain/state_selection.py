"""Partial loads: which parts of a saved state a list of dotted keys names, and which shards
hold them. Pure functions over the JSON skeleton (serialize.py), so a loader can decide what to
read before reading any tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

from ckptstore.errors import ConfigError, NotFoundError


def check_keys(keys: Sequence[str]) -> tuple[str, ...]:
    """``keys`` of a partial load as a tuple, or ConfigError: a non-empty list of dotted paths.

    ``"model.encoder"`` is ``state["model"]["encoder"]``. A dict key that itself holds dots (a
    flat ``state_dict``'s ``"encoder.weight"``) is matched too, the longest key first: so
    ``"model.encoder.weight"`` also finds ``state["model"]["encoder.weight"]``.
    """
    example = "pass a list of dotted paths, e.g. keys=['model'] or keys=['model.encoder']"
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ConfigError(f"keys must be a list of str, not {type(keys).__name__}: {example}")
    result = tuple(keys)
    if not result:
        raise ConfigError(f"keys is empty: {example}, or keys=None to load the whole state")
    for key in result:
        if not isinstance(key, str) or not all(key.split(".")):
            raise ConfigError(f"keys holds {key!r}, not a dotted path: {example}")
    return result


Selection: TypeAlias = dict[str, "Selection | None"]
"""Which parts of a dict to decode: by key, ``None`` for the whole value, else a selection
within it."""


def dict_entries(node: Any) -> dict[str, Any] | None:
    """The str-keyed entries of an encoded dict, or ``None`` if ``node`` encodes no dict."""
    if not isinstance(node, dict):
        return None
    if len(node) == 1:
        ((tag, inner),) = node.items()
        if tag == "$dict":
            return {k: v for k, v in inner if isinstance(k, str)}
        if tag.startswith("$"):
            return None
    return node


def select(skeleton: Any, keys: Iterable[str], where: str) -> Selection:
    """The selection of ``keys`` in an encoded state; NotFoundError for a key it lacks."""
    selection: Selection = {}
    for key in keys:
        *outer, last = _resolve(skeleton, key, where)
        within = selection
        for name in outer:
            inner = within.setdefault(name, {})
            if inner is None:  # an enclosing part is selected whole already
                break
            within = inner
        else:
            within[last] = None
    return selection


def _resolve(skeleton: Any, key: str, where: str) -> list[str]:
    """The dict keys that the dotted ``key`` names, outermost first; longest keys first."""
    parts = key.split(".")
    path: list[str] = []
    node, start = skeleton, 0
    while start < len(parts):
        entries = dict_entries(node)
        for end in range(len(parts), start, -1):
            name = ".".join(parts[start:end])
            if entries is not None and name in entries:
                path.append(name)
                node, start = entries[name], end
                break
        else:
            raise NotFoundError(_missing_key(skeleton, key, path, entries, where), uri=where)
    return path


def _missing_key(
    skeleton: Any, key: str, found: list[str], entries: dict[str, Any] | None, where: str
) -> str:
    top = dict_entries(skeleton)
    if top is None:
        return f"{where}: the saved state is not a dict, so it has no key {key!r}"
    message = f"{where}: the saved state has no key {key!r}"
    if found:
        inner = ".".join(found)
        message += (
            f" ({inner!r} holds no dict)"
            if entries is None
            else f" ({inner!r} holds keys {_some(entries)})"
        )
    return f"{message}; its top-level keys are {_some(top)}"


def _some(keys: Iterable[str], limit: int = 20) -> str:
    names = list(keys)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"[{shown}{more}]"


def selected_parts(node: Any, selection: Selection) -> Iterator[Any]:
    """The encoded values a selection takes whole."""
    entries = dict_entries(node) or {}
    for name, within in selection.items():
        if within is None:
            yield entries[name]
        else:
            yield from selected_parts(entries[name], within)


def shards_of(parts: Iterable[Any], shard_of: Mapping[str, str]) -> tuple[str, ...]:
    """The shards holding the tensors of encoded ``parts``, sorted; a tensor the skeleton
    does not place is left to the decoder to report."""
    names = (name for part in parts for name in _tensor_names(part))
    return tuple(sorted({shard_of[n] for n in names if n in shard_of}))


def _tensor_names(node: Any) -> Iterator[Any]:
    if isinstance(node, list):
        for item in node:
            yield from _tensor_names(item)
    elif isinstance(node, dict):
        if len(node) == 1 and "$tensor" in node:
            yield node["$tensor"]
        else:
            for value in node.values():
                yield from _tensor_names(value)
