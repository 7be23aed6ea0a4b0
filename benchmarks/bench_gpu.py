"""The GPU checks of overlapped snapshots, as one short script for a machine with CUDA.

Prints two targets with PASS/MISS:
- device-to-host snapshot throughput >= 0.8x the bandwidth of one pinned-memory copy;
- the training loop's overhead per overlapped save < 0.1x of a blocking copy of the state.

Run: ``python benchmarks/bench_gpu.py [--size-mb 2048] [--steps 12]``. Without CUDA it says so
and exits 0, so it can sit in any job. The state is a stack of linear layers with AdamW on one
device; the store is a local temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from ckptstore import CheckpointStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="state size (model + AdamW)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per mode")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU checks did not run")
        return
    width = 4096
    layers = max(1, args.size_mb * 2**20 // (3 * 4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    batch = torch.randn(256, width, device="cuda")

    def step() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(3):
        step()
    tensors = [*model.state_dict().values()] + [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    device = torch.cuda.get_device_name()
    print(f"state: {nbytes / 2**20:.0f} MiB in {len(tensors)} tensors on {device}")

    pinned_bw = _pinned_copy_bandwidth(nbytes)
    blocking = statistics.median(_blocking_copy(tensors) for _ in range(3))
    with tempfile.TemporaryDirectory() as root, CheckpointStore(root, keep_last=2) as store:
        snapshot_bw = _snapshot_bandwidth(store, model, optimizer, nbytes)
        plain = [step() for _ in range(args.steps)]
        overheads = []
        for n in range(args.steps):
            started = time.perf_counter()
            handle = store.save_async(100 + n, _state(model, optimizer), overlap=optimizer)
            elapsed = time.perf_counter() - started + step()
            overheads.append(elapsed - statistics.median(plain))
            handle.wait()
    overhead = statistics.median(overheads)
    print(f"pinned copy {pinned_bw / 1e9:.1f} GB/s; snapshot {snapshot_bw / 1e9:.1f} GB/s")
    print(f"blocking copy {blocking:.3f} s; loop overhead per overlapped save {overhead:.4f} s")
    _target("D2H snapshot >= 0.8x pinned copy", snapshot_bw / pinned_bw, 0.8, higher=True)
    _target("loop overhead per save < 0.1x blocking copy", overhead / blocking, 0.1, higher=False)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _pinned_copy_bandwidth(nbytes: int) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def _blocking_copy(tensors: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for tensor in tensors:
        tensor.to("cpu")
    return time.perf_counter() - started


def _snapshot_bandwidth(
    store: CheckpointStore, model: torch.nn.Module, optimizer: torch.optim.Optimizer, nbytes: int
) -> float:
    """Bytes over the time from the call until the copy's events completed (second save:
    the pinned buffers are reused, as in training)."""
    best = float("inf")
    for n in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        handle = store.save_async(n + 1, _state(model, optimizer), overlap=True)
        handle.snapshot_done()
        torch.cuda.synchronize()
        if n:
            best = min(best, time.perf_counter() - started)
        handle.wait()
    return nbytes / best


def _target(name: str, value: float, bound: float, *, higher: bool) -> None:
    ok = value >= bound if higher else value < bound
    margin = abs(value - bound) / bound * 100
    verdict = f"PASS (margin {margin:.0f}%)" if ok else f"MISS (by {margin:.0f}%)"
    print(f"  {name}: {value:.2f}x  {verdict}")


if __name__ == "__main__":
    main()
