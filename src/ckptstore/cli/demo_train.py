"""The demo's training job: a tiny MLP that saves to a store, and resumes from it bit for bit.

Resuming exactly needs every piece of state that influences the next step: the model, the
optimizer (Adam's moments and step count), the step number and the global torch RNG (dropout
draws from it). The data needs none: the batch of step ``k`` is generated from a seed derived
from ``k``, the way a deterministic, seekable data pipeline would. CPU matmuls are
deterministic for a fixed thread count, so the job pins one thread.

Run as ``python -m ckptstore.cli.demo_train`` with a JSON :class:`Job` on stdin (stdin, not
argv, because storage options may hold credentials, and argv is visible to every user of the
machine).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ckptstore.cli.format import human_size
from ckptstore.errors import NotFoundError
from ckptstore.store import CheckpointStore

SEED = 20240531
FEATURES, HIDDEN, BATCH = 16, 64, 64


@dataclass(frozen=True)
class Job:
    """What one training process is told: where the store is, how far to train, when to die."""

    uri: str
    steps: int
    save_every: int
    keep_last: int
    label: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    kill_at: int | None = None
    """Step after which the process SIGKILLs itself, like a preempted node (no cleanup runs)."""
    takeover: bool = False
    """Take the writer lease from a holder known to be dead (lease.py), as a scheduler would."""
    verbose: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer in every process; the caller seeds the RNG first."""
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, from its own generator: resuming needs no dataloader state."""
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    teacher = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    return x, torch.tanh(x @ teacher / 2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.item())


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """Everything the next step depends on."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
    }


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> int:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


@contextmanager
def _isolated() -> Iterator[None]:
    """One thread (deterministic matmuls) and a private RNG; the caller's settings come back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)


def reference_run(steps: int) -> dict[str, Any]:
    """The final state of an uninterrupted run, in this process, with no store at all."""
    with _isolated():
        torch.manual_seed(SEED)
        model, optimizer = build()
        for step in range(1, steps + 1):
            train_step(model, optimizer, step)
        return capture(model, optimizer, steps)


def run_job(job: Job) -> None:
    """Train from the store's latest step (or from scratch) to ``job.steps``, saving as we go."""

    def say(message: str) -> None:
        print(f"  {job.label} | {message}", flush=True)

    with (
        _isolated(),
        CheckpointStore(
            job.uri,
            keep_last=job.keep_last,
            storage_options=job.storage_options,
            takeover=job.takeover,
        ) as store,
    ):
        torch.manual_seed(SEED)
        model, optimizer = build()
        started = time.perf_counter()
        try:
            state = store.load()
        except NotFoundError:
            start = 0
            say(f"pid {os.getpid()}: no checkpoint in {store.uri}; starting from step 0")
        else:
            start = restore(model, optimizer, state)
            where = store.last_loaded.uri if store.last_loaded else store.uri
            say(
                f"pid {os.getpid()}: resumed from step {start} ({where}), "
                f"loaded and verified in {time.perf_counter() - started:.2f} s"
            )
        for step in range(start + 1, job.steps + 1):
            loss = train_step(model, optimizer, step)
            if step % job.save_every == 0:
                began = time.perf_counter()
                info = store.save(step, capture(model, optimizer, step), {"loss": loss})
                say(
                    f"step {step:3d}  loss {loss:.4f}  saved {human_size(info.size)} "
                    f"in {time.perf_counter() - began:.2f} s"
                )
            if step == job.kill_at:
                say(f"step {step:3d}  preempted: SIGKILL, no cleanup, no goodbye")
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    job = Job(**json.loads(sys.stdin.read()))
    logging.basicConfig(
        level=logging.WARNING,
        format=f"  {job.label} | %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if job.verbose:
        logging.getLogger("ckptstore").setLevel(logging.INFO if job.verbose == 1 else logging.DEBUG)
    run_job(job)


if __name__ == "__main__":
    main()
