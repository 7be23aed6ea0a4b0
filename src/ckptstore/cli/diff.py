"""``ckptstore diff URI A B``: what changed between two committed steps of one store.

Only manifests are read (two small GETs), never payload bytes: files are compared by size and
CRC32C (and SHA-256 where both manifests carry one), which is what a load verifies against. A
file an incremental save copied from an earlier step instead of uploading it records that step
(``copied_from``), so ``diff`` can say which identical files cost no upload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import click

from ckptstore.cli.common import STEP, StepRef, common_options, emit, open_store, resolve_step
from ckptstore.cli.format import format_table, format_value, human_size, plural
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import FileEntry

CHANGED, ADDED, REMOVED, SAME = "changed", "added", "removed", "identical"
_MARK = {CHANGED: "M", ADDED: "A", REMOVED: "D", SAME: "="}
_ABSENT = "(absent)"


@dataclass(frozen=True)
class FileDiff:
    """One path of either step: its status and, where it exists, its size and CRC32C there."""

    path: str
    status: str
    size_a: int | None
    size_b: int | None
    crc32c_a: str | None
    crc32c_b: str | None
    copied_from: int | None
    """The step B's save copied this file from unchanged (no upload), when it did."""


def same_bytes(a: FileEntry, b: FileEntry) -> bool:
    """Equal as far as the manifests can tell: size, CRC32C, and SHA-256 if both have one."""
    if a.size != b.size or a.crc32c != b.crc32c:
        return False
    return a.sha256 is None or b.sha256 is None or a.sha256 == b.sha256


def diff_files(a: CheckpointInfo, b: CheckpointInfo) -> list[FileDiff]:
    """Every path of either step, by path."""
    old = {f.path: f for f in a.files}
    new = {f.path: f for f in b.files}
    out = []
    for path in sorted(old.keys() | new.keys()):
        fa, fb = old.get(path), new.get(path)
        if fa is None:
            status = ADDED
        elif fb is None:
            status = REMOVED
        else:
            status = SAME if same_bytes(fa, fb) else CHANGED
        out.append(
            FileDiff(
                path,
                status,
                fa.size if fa else None,
                fb.size if fb else None,
                fa.crc32c if fa else None,
                fb.crc32c if fb else None,
                fb.copied_from if fb else None,
            )
        )
    return out


def diff_mapping(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{key: {"a": value, "b": value}}`` for the keys whose values differ; a key one side
    lacks is absent from that side's dict."""
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(a.keys() | b.keys()):
        if key in a and key in b and a[key] == b[key]:
            continue
        out[key] = {side: m[key] for side, m in (("a", a), ("b", b)) if key in m}
    return out


def diff_document(uri: str, a: CheckpointInfo, b: CheckpointInfo) -> dict[str, Any]:
    """The ``--json`` view; the human view is rendered from it."""
    files = diff_files(a, b)
    by_status = {s: [asdict(f) for f in files if f.status == s] for s in _MARK}
    return {
        "uri": uri,
        "a": {"step": a.step, "size": a.size, "files": len(a.files)},
        "b": {"step": b.step, "size": b.size, "files": len(b.files)},
        "identical": not (by_status[CHANGED] or by_status[ADDED] or by_status[REMOVED]),
        "files": by_status,
        "metadata": diff_mapping(a.metadata, b.metadata),
        "environment": diff_mapping(vars(a.manifest.environment), vars(b.manifest.environment)),
    }


def diff_text(doc: Mapping[str, Any]) -> str:
    """One line per file that differs, a summary of the identical ones, then metadata."""
    a, b, files = doc["a"], doc["b"], doc["files"]
    lines = [
        f"{doc['uri']}: step {a['step']} ({plural(a['files'], 'file')}, "
        f"{human_size(a['size'])}) -> step {b['step']} ({plural(b['files'], 'file')}, "
        f"{human_size(b['size'])})"
    ]
    rows = [_row(f) for status in (CHANGED, ADDED, REMOVED, SAME) for f in files[status]]
    if rows:
        lines += [
            "",
            format_table(["", "PATH", f"STEP {a['step']}", f"STEP {b['step']}", ""], rows),
        ]
    same = files[SAME]
    copied = [f for f in same if f["copied_from"] is not None]
    lines += [
        "",
        f"{len(files[CHANGED])} changed, {len(files[ADDED])} added, {len(files[REMOVED])} "
        f"removed, {len(same)} identical ({len(copied)} copied by the save, not uploaded: "
        f"{human_size(sum(f['size_b'] for f in copied))})",
    ]
    for title in ("metadata", "environment"):
        changes = doc[title]
        lines += ["", f"{title}:" + ("" if changes else " no differences")]
        lines += [
            f"  {key}: {_value(sides, 'a')} -> {_value(sides, 'b')}"
            for key, sides in changes.items()
        ]
    return "\n".join(lines)


def _row(f: Mapping[str, Any]) -> list[str]:
    def cell(size: int | None, crc: str | None) -> str:
        return "-" if size is None else f"{human_size(size)} {crc}"

    note = f"copied from step {f['copied_from']}" if f["copied_from"] is not None else ""
    return [
        _MARK[f["status"]],
        f["path"],
        cell(f["size_a"], f["crc32c_a"]),
        cell(f["size_b"], f["crc32c_b"]),
        note,
    ]


def _value(sides: Mapping[str, Any], side: str) -> str:
    return format_value(sides[side]) if side in sides else _ABSENT


@click.command("diff")
@click.argument("uri")
@click.argument("a", metavar="A", type=STEP)
@click.argument("b", metavar="B", type=STEP)
@common_options
@click.pass_context
def diff_command(ctx: click.Context, uri: str, a: StepRef, b: StepRef) -> None:
    """Compare steps A and B of URI (numbers or 'latest') from their manifests alone.

    Lists the files that changed, were added, removed, or are identical (and which of those
    B's save copied instead of uploading them), then how metadata and versions differ.
    """
    store = open_store(ctx, uri)
    info_a = store.info(resolve_step(store, a))
    info_b = store.info(resolve_step(store, b))
    doc = diff_document(store.uri, info_a, info_b)
    emit(ctx, doc, lambda: diff_text(doc))


COMMANDS = [diff_command]
