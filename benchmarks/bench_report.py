"""The benchmark's table and its "targets" section, from the rows' JSON results."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
Result = dict[str, Any]


def _find(results: list[Result], target: str, name: str) -> Result | None:
    for r in results:
        if (r["target"], r["row"]) == (target, name) and r.get("ok"):
            return r
    return None


def _limit(results: list[Result], target: str, kind: str) -> Result | None:
    names = {
        ("local", "save"): "raw write+fsync",
        ("local", "load"): "raw read",
        ("s3", "save"): "raw boto3 multipart upload",
        ("s3", "load"): "raw boto3 download",
    }
    return _find(results, target, names[(target, kind)])


def blocked_ratio(r: Result) -> float:
    return float(statistics.median(r["extras"]["blocked"]) / r["notes"]["clone_s"])


def _notes(r: Result) -> str:
    if not r.get("ok"):
        return f"did not run: {r.get('error', '?')}"
    mbs = [r["state_bytes"] / 1e6 / s for s in r["seconds"]]
    parts = [f"runs {min(mbs):.0f}-{max(mbs):.0f}" if len(mbs) > 1 else ""]
    notes, extras = r.get("notes", {}), r.get("extras", {})
    if "blocked" in extras:
        blocked = extras["blocked"]
        parts.append(
            f"blocked {statistics.median(blocked):.3f}s = {blocked_ratio(r):.2f}x clone "
            f"({notes['clone_s']:.3f}s); 1st save {blocked[0]:.3f}s"
        )
    if "changed_fraction" in notes:
        parts.append(f"changed {notes['changed_fraction']:.1%}")
    uploaded = extras.get("uploaded", [1.0])
    if r["row"].endswith("incremental") or min(uploaded) < 0.99:
        parts.append(f"uploaded {statistics.median(extras['uploaded']):.1%} of bytes")
    if "best" in notes:
        parts.append(f"best of sweep: {notes['best']}")
    single = notes.get("sweep", {}).get("1 file, 1 call")
    if single:
        verb = "write" if r["kind"] == "save" else "read"
        parts.append(f"1 file, 1 {verb}: {r['state_bytes'] / 1e6 / single:.0f} MB/s")
    if r["target"] == "local" and r["kind"] == "load":
        parts.append("cold page cache")
    return "; ".join(p for p in parts if p)


def table(results: list[Result]) -> str:
    header = ("target", "method", "MB/s", "vs raw", "extra RSS MiB", "notes")
    lines = [header]
    for r in results:
        limit = _limit(results, r["target"], r["kind"])
        if r.get("ok"):
            speed = f"{r['mb_s']:.0f}"
            ratio = f"{r['mb_s'] / limit['mb_s']:.2f}x" if limit else "n/a"
            rss = f"{r['extra_rss'] / MiB:.0f}"
        else:
            speed = ratio = rss = "-"
        lines.append((r["target"], r["row"], speed, ratio, rss, _notes(r)))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    out = []
    for n, line in enumerate(lines):
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        cells += [c.rjust(w) for c, w in zip(line[2:5], widths[2:5], strict=True)]
        out.append("  ".join([*cells, line[5]]).rstrip())
        if n == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


@dataclass(frozen=True)
class Target:
    text: str
    bound: float
    at_least: bool
    value: Callable[[list[Result]], float | None]
    unit: str = ""
    """Shown after the ratio ("x<unit>"); "%" shows a fraction as a percentage instead."""


def _speed_ratio(target: str, name: str, other: Callable[[list[Result]], Result | None]) -> Any:
    def value(results: list[Result]) -> float | None:
        mine, ref = _find(results, target, name), other(results)
        return mine["mb_s"] / ref["mb_s"] if mine and ref else None

    return value


def _blocked(target: str) -> Callable[[list[Result]], float | None]:
    def value(results: list[Result]) -> float | None:
        r = _find(results, target, "ckptstore save_async")
        return blocked_ratio(r) if r else None

    return value


def _uploaded(target: str) -> Callable[[list[Result]], float | None]:
    def value(results: list[Result]) -> float | None:
        r = _find(results, target, "ckptstore incremental")
        return float(statistics.median(r["extras"]["uploaded"])) if r else None

    return value


def _memory(target: str, part_size: int, concurrency: int, row: str = "ckptstore save") -> Any:
    def value(results: list[Result]) -> float | None:
        r = _find(results, target, row)
        if r is None:
            return None
        return float(r["extra_rss"] / (part_size * concurrency + 0.1 * r["state_bytes"]))

    return value


def targets(part_size: int, concurrency: int) -> list[Target]:
    def limit(target: str, kind: str) -> Callable[[list[Result]], Result | None]:
        return lambda results: _limit(results, target, kind)

    def row(target: str, name: str) -> Callable[[list[Result]], Result | None]:
        return lambda results: _find(results, target, name)

    bound = f"{part_size // MiB} MiB part x {concurrency} + 10% of the state"
    return [
        Target(
            "S3 save >= 0.9x raw boto3 multipart upload",
            0.9,
            True,
            _speed_ratio("s3", "ckptstore save", limit("s3", "save")),
        ),
        Target(
            "S3 save >= 1.5x torch.save>s3fs.open",
            1.5,
            True,
            _speed_ratio("s3", "ckptstore save", row("s3", "torch.save>s3fs.open")),
        ),
        Target(
            "local save >= 0.9x raw write+fsync",
            0.9,
            True,
            _speed_ratio("local", "ckptstore save", limit("local", "save")),
        ),
        Target(
            "local load >= 0.9x raw read",
            0.9,
            True,
            _speed_ratio("local", "ckptstore load", limit("local", "load")),
        ),
        Target(
            "S3 load >= 0.9x raw boto3 download",
            0.9,
            True,
            _speed_ratio("s3", "ckptstore load", limit("s3", "load")),
        ),
        Target(
            "S3 load >= 1.5x s3fs.open>torch.load",
            1.5,
            True,
            _speed_ratio("s3", "ckptstore load", row("s3", "s3fs.open>torch.load")),
        ),
        Target("local save_async blocked <= 1.5x clone", 1.5, False, _blocked("local")),
        Target("S3 save_async blocked <= 1.5x clone", 1.5, False, _blocked("s3")),
        Target(
            f"S3 sync save extra RSS <= {bound}",
            1.0,
            False,
            _memory("s3", part_size, concurrency),
            " of the bound",
        ),
        Target(
            "local sync save extra RSS <= the same bound",
            1.0,
            False,
            _memory("local", part_size, concurrency),
            " of the bound",
        ),
        Target(
            "DCP save extra RSS <= part x concurrency + 10% of the state (S3)",
            1.0,
            False,
            _memory("s3", part_size, concurrency, "ckptstore dcp.save"),
            " of the bound",
        ),
        Target(
            "DCP save extra RSS <= the same bound (local)",
            1.0,
            False,
            _memory("local", part_size, concurrency, "ckptstore dcp.save"),
            " of the bound",
        ),
        Target("local incremental uploads <= 15% of bytes", 0.15, False, _uploaded("local"), "%"),
        Target("S3 incremental uploads <= 15% of bytes", 0.15, False, _uploaded("s3"), "%"),
    ]


def verdicts(results: list[Result], part_size: int, concurrency: int) -> str:
    lines = []
    for t in targets(part_size, concurrency):
        value = t.value(results)
        if value is None:
            lines.append(f"  {t.text}: not measured")
            continue
        shown = f"{value:.1%}" if t.unit == "%" else f"{value:.2f}x{t.unit}"
        ok = value >= t.bound if t.at_least else value <= t.bound
        off = abs(value / t.bound - 1)
        verdict = f"PASS (margin {off:.0%})" if ok else f"MISS (by {off:.0%})"
        lines.append(f"  {t.text}: {shown}  {verdict}")
    return "\n".join(lines)
