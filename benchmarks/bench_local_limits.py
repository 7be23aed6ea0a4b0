"""The raw local-disk limits: the same bytes written (and read back) at the best of a sweep.

The issue's limit is one ``write`` of all the bytes and one ``fsync``; that is the first
setting swept. This machine's virtual disk is often faster with several writers, each fsyncing
its own files, so the sweep also cuts the bytes into files of 32 or 128 MiB written by 4 or 8
threads (each file fsynced; ``os.write``/``os.preadv`` release the GIL). Every setting is timed
twice and keeps its faster time (the disk's speed swings several-fold from minute to minute);
the fastest setting is the row's limit, so a method that writes many files in parallel is not
flattered by a single-stream limit. Reads mirror this: one ``readinto`` of the whole file, or
the files read into one fresh buffer by several threads, with the page cache dropped before
each read. The single-file figure is kept in the notes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bench_state as st
import torch
from bench_methods import Method

MiB = 1 << 20
WHOLE = 1 << 62
Config = tuple[int, int]
"""(file size in bytes, or WHOLE for one file; threads)."""
CONFIGS: list[Config] = [(WHOLE, 1), (32 * MiB, 4), (32 * MiB, 8), (128 * MiB, 4)]


def _cuts(total: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, total)) for a in range(0, total, size)]


def _label(config: Config) -> str:
    files, threads = config
    return "1 file, 1 call" if files >= WHOLE else f"{files // MiB} MiB files x {threads} threads"


def _configs(quick: bool) -> list[Config]:
    return CONFIGS[:1] if quick else CONFIGS


def _sweep(timed: Callable[[Config], float], quick: bool) -> tuple[Config, dict[str, float]]:
    """Two rounds, the faster of each setting's two times: the disk's speed swings widely.
    ``quick`` (a smoke run) times the first setting once."""
    tried = {config: timed(config) for config in _configs(quick)}
    if not quick:
        tried = {config: min(seconds, timed(config)) for config, seconds in tried.items()}
    best = min(tried, key=tried.__getitem__)
    return best, {_label(c): round(s, 3) for c, s in tried.items()}


def write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def write_files(directory: Path, data: memoryview, config: Config) -> None:
    files, threads = config
    directory.mkdir(parents=True, exist_ok=True)
    cuts = _cuts(len(data), files)
    with ThreadPoolExecutor(threads) as pool:
        jobs = [
            pool.submit(write_file, directory / f"{n:05d}", data[a:b])
            for n, (a, b) in enumerate(cuts)
        ]
        for job in jobs:
            job.result()


def read_files(directory: Path, out: memoryview, config: Config) -> None:
    def read(n: int, a: int, b: int) -> None:
        fd, filled = os.open(directory / f"{n:05d}", os.O_RDONLY), 0
        try:
            while a + filled < b and (k := os.preadv(fd, [out[a + filled : b]], filled)):
                filled += k
        finally:
            os.close(fd)

    files, threads = config
    with ThreadPoolExecutor(threads) as pool:
        jobs = [pool.submit(read, n, a, b) for n, (a, b) in enumerate(_cuts(len(out), files))]
        for job in jobs:
            job.result()


class RawWrite(Method):
    """The same bytes written and fsynced, at the best layout of the sweep."""

    def setup(self, state: Any) -> None:
        self.flat = st.flat_bytes(state).numpy().data
        self.best, sweep = _sweep(self._timed, self.spec.quick)
        self.notes |= {"best": _label(self.best), "sweep": sweep}

    def _timed(self, config: Config) -> float:
        self.trials = getattr(self, "trials", 0) + 1
        started = time.perf_counter()
        write_files(self.dir / f"sweep-{self.trials}", self.flat, config)
        return time.perf_counter() - started

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        write_files(self.dir / f"raw-{i}", self.flat, self.best)
        return None, {}


class RawRead(Method):
    """The same bytes read from disk (page cache dropped) into a fresh buffer, best of sweep."""

    kind = "load"

    def setup(self, state: Any) -> None:
        flat = st.flat_bytes(state)
        self.crc, self.size = st.fingerprint(flat), flat.numel()
        for config in _configs(self.spec.quick):
            write_files(self._dir(config), flat.numpy().data, config)
        del flat
        self.best, sweep = _sweep(self._timed, self.spec.quick)
        self.notes |= {"best": _label(self.best), "sweep": sweep}

    def _dir(self, config: Config) -> Path:
        return self.dir / f"layout-{config[0]}"

    def _timed(self, config: Config) -> float:
        st.evict(self.dir)
        started = time.perf_counter()
        self.read(config)
        return time.perf_counter() - started

    def read(self, config: Config) -> torch.Tensor:
        out = torch.empty(self.size, dtype=torch.uint8)
        read_files(self._dir(config), out.numpy().data, config)
        return out

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        return self.read(self.best), {}

    def verify(self, out: Any) -> None:
        if st.fingerprint(out) != self.crc:
            raise AssertionError("raw read returned other bytes")
