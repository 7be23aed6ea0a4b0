"""How the CLI and the demo show steps to people (tables) and to programs (JSON records).

Both views are built from the same record, so ``ckptstore ls`` and ``ckptstore ls --json`` never
disagree. Times are UTC ISO 8601, sizes binary (KiB, MiB) in tables and plain bytes in JSON.
Nothing here touches storage, and nothing here ever prints storage options (credentials).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import Environment
from ckptstore.domain.retention import metric_value

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_MAX_METADATA_WIDTH = 60


def human_size(size: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; bytes stay exact below 1 KiB."""
    value = float(size)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "file")`` -> ``"1 file"``, ``plural(3, "file")`` -> ``"3 files"``; ``many``
    for irregular words (``plural(2, "entry", "entries")``)."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def iso_time(seconds: float) -> str:
    """Seconds since the epoch as UTC ISO 8601, to the second: ``2025-01-31T12:00:00Z``."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_value(value: Any) -> str:
    """A metadata value for a table: floats to 4 significant digits, the rest as JSON."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def metadata_summary(metadata: Mapping[str, Any]) -> str:
    """``loss=0.1234 lr=0.001``: scalar metadata in one cell, cut to fit a terminal."""
    parts = [
        f"{key}={format_value(value)}"
        for key, value in sorted(metadata.items())
        if isinstance(value, (str, int, float, bool)) or value is None
    ]
    text = " ".join(parts)
    return text if len(text) <= _MAX_METADATA_WIDTH else text[: _MAX_METADATA_WIDTH - 3] + "..."


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "") -> str:
    """Columns padded to their widest cell; columns whose cells are all numbers align right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        bool(rows) and all(isinstance(row[i], (int, float)) for row in rows)
        for i in range(len(headers))
    ]

    def line(row: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(row, widths, numeric, strict=True)
        ]
        return (indent + "  ".join(padded)).rstrip()

    return "\n".join([line(headers), *(line(row) for row in cells)])


def format_pairs(pairs: Sequence[tuple[str, Any]], indent: str = "") -> str:
    """``key  value`` lines with the values aligned; ``None`` shows as ``-``."""
    width = max((len(key) for key, _ in pairs), default=0)
    return "\n".join(
        f"{indent}{key.ljust(width)}  {'-' if value is None else value}".rstrip()
        for key, value in pairs
    )


def step_record(
    info: CheckpointInfo,
    *,
    latest: int | None,
    pins: Collection[int],
    fenced: Collection[int] = (),
    prune: Collection[int] | None = None,
) -> dict[str, Any]:
    """One committed step as a JSON-ready dict (the row of ``ls --json``); ``prune``, the
    steps retention would delete, adds whether this is one of them."""
    record = {
        "step": info.step,
        "uri": info.uri,
        "time": iso_time(info.time),
        "created": info.time,
        "size": info.size,
        "files": info.file_count,
        "kind": info.kind,
        "pinned": info.step in pins,
        "latest": info.step == latest,
        "fenced": info.step in fenced,
        "metadata": dict(info.metadata),
    }
    if prune is not None:
        record["prune"] = info.step in prune
    if info.tier is not None:
        record["tier"] = info.tier
    return record


def steps_table(
    infos: Sequence[CheckpointInfo],
    *,
    latest: int | None,
    pins: Collection[int],
    fenced: Collection[int] = (),
    prune: Collection[int] | None = None,
    indent: str = "",
) -> str:
    """The human view of ``ls``: one row per committed step, in the order given. A step that a
    writer committed after losing the lease is marked ``fenced``: it is never loaded as latest.
    With ``prune`` (the steps retention would delete) a PRUNE column marks them; a tiered
    store's steps get a TIER column (where they are: local, durable or both)."""
    rows = []
    tiered = any(info.tier is not None for info in infos)
    for info in infos:
        record = step_record(info, latest=latest, pins=pins, fenced=fenced, prune=prune)
        row = [
            record["step"],
            record["time"],
            human_size(record["size"]),
            record["files"],
            "pinned" if record["pinned"] else "",
            "latest" if record["latest"] else "fenced" if record["fenced"] else "",
        ]
        if prune is not None:
            row.append("prune" if record["prune"] else "")
        if tiered:
            row.append(record.get("tier", ""))
        rows.append([*row, metadata_summary(record["metadata"])])
    headers = ["STEP", "TIME (UTC)", "SIZE", "FILES", "PINNED", "LATEST"]
    headers += ["PRUNE"] if prune is not None else []
    headers += ["TIER"] if tiered else []
    return format_table([*headers, "METADATA"], rows, indent)


def order_steps(
    infos: Sequence[CheckpointInfo], metric: str | None, *, reverse: bool = False
) -> list[CheckpointInfo]:
    """Steps by ``metric``, a number in their metadata, lowest first (``reverse``: highest
    first), ties by step; steps without a number for it last, by step. Without ``metric``:
    by step (``reverse``: newest first)."""
    by_step = sorted(infos, key=lambda i: i.step)
    if metric is None:
        return by_step[::-1] if reverse else by_step
    scored = [(v, i) for i in by_step if (v := metric_value(i.metadata, metric)) is not None]
    scored.sort(key=lambda pair: pair[0], reverse=reverse)  # stable: ties stay by step
    unscored = [i for i in by_step if metric_value(i.metadata, metric) is None]
    return [i for _, i in scored] + unscored


def total_line(
    shown: Sequence[CheckpointInfo],
    every: Sequence[CheckpointInfo],
    prune: Collection[int] | None = None,
) -> str:
    """The line under ``ls``'s table: the store's steps and bytes (and those shown, when fewer,
    and what retention would free)."""
    line = f"total: {plural(len(every), 'step')}, {human_size(sum(i.size for i in every))}"
    if len(shown) < len(every):
        line += f" ({len(shown)} shown, {human_size(sum(i.size for i in shown))})"
    if prune is not None:
        freed = sum(i.size for i in every if i.step in prune)
        line += f"; prune would delete {plural(len(prune), 'step')}, {human_size(freed)}"
    return line


def versions_table(infos: Sequence[CheckpointInfo], indent: str = "") -> str:
    """Which versions, host and process wrote each step (from the manifests' environment)."""
    headers = ["STEP", "CKPTSTORE", "TORCH", "PYTHON", "VERL", "HOST", "WRITER"]
    rows = []
    for info in infos:
        env: Environment = info.manifest.environment
        rows.append(
            [
                info.step,
                env.ckptstore,
                env.torch or "-",
                env.python,
                env.verl or "not installed",
                env.hostname,
                info.manifest.writer,
            ]
        )
    return format_table(headers, rows, indent)
