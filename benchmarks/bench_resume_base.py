"""What bench_resume.py's rows share: the state, the S3 server on loopback, a row, raw reads."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptstore.domain import layout

MiB = 1 << 20
BUCKET = "bench"
REGION, KEY = "us-east-1", "testing"


State = dict[str, dict[str, torch.Tensor]]


def state_of(size_mb: float, tensors: int, seed: int = 0) -> State:
    """``tensors`` float32 tensors of ``size_mb`` MiB in all, from a fixed seed, under one
    top-level key as a model's ``state_dict`` (ckptstore cuts it into shards of 32 MiB)."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, int(size_mb * MiB) // tensors // 4)
    return {"model": {f"t{i:03d}": torch.rand(per, generator=gen) for i in range(tensors)}}


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def flat_bytes(state: State) -> memoryview:
    """The state's tensor bytes, one after another, in one buffer."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state["model"].values()])
    return memoryview(flat.numpy()).cast("B")


def payload(path: str) -> bool:
    """Whether ``path`` is a payload file of a step (not its manifest or attempt marker)."""
    return not path.endswith((layout.MANIFEST_NAME, layout.ATTEMPT_MARKER))


def cuts(total: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, total)) for a in range(0, total, size)] or [(0, 0)]


# -- the S3 server and clients ----------------------------------------------------------------


MEMORY_DIR = Path("/dev/shm")


class Server:
    """moto's S3 server in a process of its own, on a free port of 127.0.0.1.

    moto keeps each object over 5 MiB in a temporary file; those go to a memory file system
    (``TMPDIR=/dev/shm``) where it has ``room`` bytes free (what the rows may leave in the
    bucket at once). On disk, py-spy of the server showed writing them taking 6x the samples
    with earlier objects on disk beside them: a cost that fell on whichever row wrote next,
    not on the row that left them."""

    def __init__(self, room: int = 0) -> None:
        self.room = room

    def __enter__(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "ckptstore.testing.s3server", "--port", str(self.port)]
        env = os.environ | ({"TMPDIR": str(MEMORY_DIR)} if self._memory_has_room() else {})
        self.proc = subprocess.Popen([*cmd, "--bucket", BUCKET], stdout=subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # printed once the bucket exists
        if not line:
            raise RuntimeError(f"the S3 server did not start (exit {self.proc.wait()})")
        return self

    def _memory_has_room(self) -> bool:
        if not MEMORY_DIR.is_dir():
            return False
        fs = os.statvfs(MEMORY_DIR)
        return fs.f_bavail * fs.f_frsize >= self.room

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    def settle(self, window: float = 0.05, busy: float = 0.1, limit: float = 2.0) -> None:
        """Wait (``limit`` seconds at most) until the server spent under ``busy`` of a core
        over ``window`` seconds: a row must not pay for what the row before it left the
        server doing (moto finishing a large upload, freeing deleted objects)."""
        stat = Path(f"/proc/{self.proc.pid}/stat")
        if not stat.exists():
            return
        tick = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            fields = stat.read_text().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            before = cpu()
            time.sleep(window)
            if cpu() - before < busy * window:
                return

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, "key": KEY, "secret": KEY, "region": REGION}

    def client(self, pool: int = 64) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            max_pool_connections=pool,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=KEY,
            aws_secret_access_key=KEY,
            config=config,
        )


def fsspec_options(server: Server) -> dict[str, Any]:
    return {
        "endpoint_url": server.url,
        "key": KEY,
        "secret": KEY,
        "client_kwargs": {"region_name": REGION},
    }


# -- rows -------------------------------------------------------------------------------------


@dataclass
class Row:
    """One method: ``run()`` is timed, ``prep()`` (untimed) runs just before it."""

    group: str
    name: str
    role: str  # "ckptstore", "limit", "peer", or "line" (a bound that is not the limit)
    run: Callable[[], Any]
    prep: Callable[[], None] = lambda: None
    seconds: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def raw_read(
    files: list[Path], piece: int | None, conc: int, *, in_order: bool = False
) -> list[torch.Tensor]:
    """``files`` read into fresh buffers by ``conc`` threads (whole files, or pieces); with
    ``in_order``, each file by one thread, front to back, one ``piece`` per call."""
    sizes = {p: p.stat().st_size for p in files}
    out = {p: torch.empty(s, dtype=torch.uint8) for p, s in sizes.items()}
    fds = {p: os.open(p, os.O_RDONLY) for p in files}

    call = piece if in_order and piece else 64 * MiB

    def one(task: tuple[Path, int, int]) -> None:
        path, a, b = task
        view = memoryview(out[path].numpy())
        while a < b:
            n = os.preadv(fds[path], [view[a : min(b, a + call)]], a)
            if not n:
                raise AssertionError(f"{path}: ended early")
            a += n

    cut = None if in_order else piece
    tasks = [(p, a, b) for p, s in sizes.items() for a, b in cuts(s, cut or max(s, 1))]
    try:
        with ThreadPoolExecutor(min(conc, len(tasks))) as pool:
            list(pool.map(one, tasks))
    finally:
        for fd in fds.values():
            os.close(fd)
    return list(out.values())
