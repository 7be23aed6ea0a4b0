"""Step time over a training run with checkpoints, from ``bench_stall.py --json``.

    python benchmarks/plot_stall.py stall.json docs/step-time.png

One panel per target (local directory, S3): the time of each loop iteration (forward,
backward, optimizer step and the save call after it) for the no-checkpoint baseline and for
blocking, async and overlapped saves, from the first round of the benchmark; dotted lines mark
the steps after which a save was called. The y axis is logarithmic, so a blocking save's
seconds and an overlapped save's milliseconds are both readable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator

STYLE = {
    "none": ("no checkpoint", "0.6", "-"),
    "blocking": ("save (blocking)", "tab:red", "-"),
    "async": ("save_async", "tab:orange", "-"),
    "overlapped": ("save_async(overlap=optimizer)", "tab:blue", "-"),
}
TITLES = {"local": "local directory", "s3": "S3 (moto on 127.0.0.1)"}


def iteration_times(run: dict[str, Any]) -> list[float]:
    """What the loop spent per step: forward+backward, optimizer step, then the save call."""
    return [f + o + c for f, o, c in zip(run["fb"], run["opt"], run["call"], strict=True)]


def pick(runs: list[dict[str, Any]], target: str, mode: str) -> dict[str, Any] | None:
    """The first round's run of ``mode`` on ``target`` (the baseline has target "-")."""
    for run in runs:
        if run["mode"] == mode and run["target"] in (target, "-") and not run.get("error"):
            return run
    return None


def plot(data: dict[str, Any], out: Path) -> None:
    runs = data["runs"]
    targets = [t for t in ("local", "s3") if any(r["target"] == t for r in runs)]
    if not targets:
        raise SystemExit("plot_stall: the JSON has no local or s3 runs")
    fig, axes = plt.subplots(len(targets), 1, figsize=(8, 3.2 * len(targets)), squeeze=False)
    meta = data["meta"]
    clone = statistics.median(meta["clone_s"])
    for ax, target in zip(axes[:, 0], targets, strict=True):
        for mode, (label, color, style) in STYLE.items():
            run = pick(runs, target, mode)
            if run is None:
                continue
            times = iteration_times(run)
            steps = range(1, len(times) + 1)
            ax.plot(steps, times, style, color=color, label=label, linewidth=1.4, marker=".")
            if mode != "none":
                saved = [i + 1 for i in run["saves"]]
                ax.plot(saved, [times[i - 1] for i in saved], "v", color=color, markersize=7)
        for point in meta["save_points"]:
            ax.axvline(point + 1, color="0.8", linestyle=":", linewidth=1, zorder=0)
        ax.axhline(clone, color="0.4", linestyle="--", linewidth=0.8)
        ax.annotate("1 clone of the state", (1, clone), xytext=(2, 2), fontsize=7,
                    textcoords="offset points", color="0.4")  # fmt: skip
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2, 3, 5)))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(TITLES[target], fontsize=10)
        ax.set_ylabel("iteration time (s)")
        ax.grid(True, which="major", axis="y", color="0.92")
    axes[-1, 0].set_xlabel("training step (saves after the steps marked v and dotted)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(
        f"Step time with a checkpoint every {data['args']['every']} steps (first round)\n"
        f"{meta['state_bytes'] / 1e6:.0f} MB model + AdamW state, {meta['cpus']} CPUs, "
        f"{meta['torch_threads']} training thread(s)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("json", type=Path, help="written by bench_stall.py --json")
    p.add_argument("png", type=Path, nargs="?", default=Path("docs/step-time.png"))
    args = p.parse_args(argv)
    plot(json.loads(args.json.read_text()), args.png)
    print(f"plot_stall: wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
