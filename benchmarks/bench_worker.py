"""One table row, measured in a fresh process: forked by bench.py, or run by hand as
``bench_worker.py SPEC.json RESULT.json``.

A fresh process per row keeps rows from sharing allocator state, page cache warm-up or
threads, and makes the peak RSS a property of one method. The state is built here, from the
fixed seed; the S3 server runs in the parent, so its memory is not counted.

Extra peak RSS = peak RSS during the timed runs minus RSS just before them; for a load row,
minus the loaded state's own size as well (the state is freed before a load row's runs).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bench_state as st
from bench_methods import S3Target, Spec, catalog


def measure(spec: Spec) -> dict[str, Any]:
    row = next(r for r in catalog() if (r.target, r.name) == (spec.target, spec.row))
    method = row.factory(spec)
    state: Any = st.build_state(spec.size_bytes)
    size = st.nbytes(state)
    try:
        method.setup(state)
        if method.kind == "load":
            del state
            state = None
            gc.collect()
        baseline = st.rss()
        st.reset_peak()
        seconds: list[float] = []
        extras: dict[str, list[float]] = {}
        for i in range(spec.runs):
            method.before(i, state)
            started = time.perf_counter()
            out, extra = method.run(i, state)
            seconds.append(time.perf_counter() - started)
            if method.kind == "load":
                method.verify(out)
            del out
            for name, value in extra.items():
                extras.setdefault(name, []).append(value)
        high = st.peak()
        method.finish(state)
    finally:
        method.close()
    return {
        "state_bytes": size,
        "seconds": seconds,
        "mb_s": size / 1e6 / statistics.median(seconds),
        "extra_rss": high - baseline - (size if method.kind == "load" else 0),
        "extras": extras,
        "notes": method.notes,
    }


def main(spec_path: str, result_path: str) -> int:
    raw = json.loads(Path(spec_path).read_text())
    raw["s3"] = S3Target(**raw["s3"]) if raw.get("s3") else None
    spec = Spec(**raw)
    try:
        result: dict[str, Any] = {"ok": True, **measure(spec)}
    except Exception as e:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    result |= {"row": spec.row, "target": spec.target, "spec": asdict(spec)}
    Path(result_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
