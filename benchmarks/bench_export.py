"""How fast, and in how much memory, a verl step becomes a Hugging Face model.

    scripts/bench-export                         # a 1 GiB Llama on 4 ranks, local dir + S3 (moto)
    python benchmarks/bench_export.py --size-mb 64 --rows local-local --merger

A Llama-shaped model (fp32, fixed seed, about ``--size-mb``) is saved as verl's FSDP2 actor
files on ``--world`` ranks (DTensor ``Shard(0)``, ``torch.chunk``'s uneven rows) and committed
to a store: a local directory, and S3 (moto on 127.0.0.1 in this process, or
``--endpoint-url``). Each row runs ``ckptstore export`` in a fresh process and measures its
wall time and its extra peak RSS: ``VmHWM`` after a reset, minus ``VmRSS`` before the export,
with the store already opened. The bound is the issue's: the largest output shard's tensors
(``--shard-size-mb``). Every exported tensor is then compared bit for bit with the one the
seed generates, outside the timing. ``--merger`` adds verl's own ``model_merger`` on the same
step (a local directory is all it reads), measured the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from bench_state import peak, reset_peak, rss

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20
SEED = 20240611


# -- the model --------------------------------------------------------------------------------


def llama(size_bytes: int) -> dict[str, Any]:
    """A LlamaConfig whose fp32 weights take about ``size_bytes``."""
    hidden = 1024 if size_bytes >= 512 * MiB else 256
    inter = (int(2.75 * hidden) + 63) // 64 * 64
    vocab = 32000 if hidden == 1024 else 8000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((size_bytes / 4 - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items()]


def tensor(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + index))


def write_step(root: Path, config: dict[str, Any], world: int) -> int:
    """verl's FSDP2 actor files for ``world`` ranks; returns the model's bytes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    actor = root / "actor"
    (actor / "huggingface").mkdir(parents=True)
    full = {n: tensor(i, s) for i, (n, s) in enumerate(shapes(config))}
    for rank in range(world):
        ranks = torch.arange(world)
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("fsdp",), _init_backend=False, _rank=rank)
        state = {}
        for name, whole in full.items():
            chunks = torch.chunk(whole, world)
            local = chunks[rank].clone() if rank < len(chunks) else whole[:0].clone()
            state[name] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride()
            )
        torch.save(state, actor / f"model_world_size_{world}_rank_{rank}.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    (actor / "huggingface" / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer(config["vocab_size"]).save_pretrained(actor / "huggingface")
    return sum(t.nbytes for t in full.values())


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over the vocabulary, built offline (verl's merger needs one)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)} | {"<unk>": vocab - 1}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")), unk_token="<unk>"
    )


def largest_shard(config: dict[str, Any], shard_size: int) -> int:
    sizes, current = [], 0
    for _, shape in shapes(config):
        nbytes = math.prod(shape) * 4
        if current and current + nbytes > shard_size:
            sizes.append(current)
            current = 0
        current += nbytes
    return max([*sizes, current])


# -- one row, in its own process ----------------------------------------------------------------


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one export (or verl's merger), measured; then check the bits, unmeasured."""
    from ckptstore import CheckpointStore
    from ckptstore.export import export_hf

    result: dict[str, Any] = {}
    if spec["row"] == "merger":
        argv = ["merge", "--backend", "fsdp", "--local_dir", spec["local_dir"]]
        sys.argv = ["verl.model_merger", *argv, "--target_dir", spec["out"]]
        import verl.model_merger.__main__  # noqa: F401  (imports outside the measurement)

        before = rss()
        reset_peak()
        started = time.perf_counter()
        runpy.run_module("verl.model_merger", run_name="__main__")
    else:
        from ckptstore.backends.registry import open_backend

        store = CheckpointStore(spec["uri"], storage_options=spec["options"], lease=False)
        store.list()  # clients exist before the measurement: their setup is not the export's
        if spec["out_options"] is not None:
            open_backend(spec["out"], spec["out_options"]).stat("warm-up")
        before = rss()
        reset_peak()
        started = time.perf_counter()
        report = export_hf(
            store,
            1,
            spec["out"],
            shard_size=spec["shard_size"],
            storage_options=spec["out_options"],
        )
        result["bytes_read"] = report.bytes_read
    result["seconds"] = time.perf_counter() - started
    result["extra_rss"] = peak() - before
    result["mismatches"] = check(spec)
    return result


def check(spec: dict[str, Any]) -> int:
    """Tensors of the output that differ from the seed's, bit for bit (verl's merger writes
    bf16: its tensors are compared with the seed's cast to bf16)."""
    from safetensors.torch import load

    from ckptstore.backends.registry import open_backend

    backend = open_backend(spec["out"], spec.get("out_options"))
    names = {n: i for i, (n, _) in enumerate(shapes(spec["config"]))}
    wrong = 0
    for obj in sorted(backend.list(""), key=lambda o: o.path):
        if not obj.path.endswith(".safetensors"):
            continue
        for name, value in load(backend.read(obj.path)).items():
            expected = tensor(names.pop(name), tuple(value.shape))
            if spec["row"] == "merger":
                expected = expected.to(value.dtype)
            if value.dtype != expected.dtype or not torch.equal(value, expected):
                wrong += 1
    backend.close()
    return wrong + len(names)


# -- the table --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="model size (fp32), default 1024")
    p.add_argument("--world", type=int, default=4, help="ranks of the verl step, default 4")
    p.add_argument("--shard-size-mb", type=int, default=256, help="output shard size (256)")
    p.add_argument("--endpoint-url", help="an S3 endpoint instead of moto (AWS_* credentials)")
    p.add_argument("--bucket", default="ckptstore-bench", help="bucket (created on moto)")
    p.add_argument(
        "--rows",
        default="local-local,local-s3,s3-local,s3-s3",
        help="export rows, SOURCE-DEST with local (a directory) or s3; default all four",
    )
    p.add_argument("--merger", action="store_true", help="also run verl's model_merger")
    p.add_argument("--json", type=Path, help="write every row here")
    p.add_argument("--tmpdir", type=Path, help="where local files go")
    p.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker[0].read_text())
        args.worker[1].write_text(json.dumps(worker(spec)))
        return 0
    wanted = [tuple(r.strip().split("-")) for r in args.rows.split(",") if r.strip()]
    if any(len(r) != 2 or not set(r) <= {"local", "s3"} for r in wanted):
        raise SystemExit(f"--rows {args.rows!r}: give SOURCE-DEST pairs of local and s3")
    config = llama(args.size_mb * MiB)
    shard_size = args.shard_size_mb * MiB
    base = Path(tempfile.mkdtemp(prefix="ckptstore-bench-export-", dir=args.tmpdir))
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        step = base / "global_step_1"
        model_bytes = write_step(step, config, args.world)
        bound = largest_shard(config, shard_size)
        stores: dict[str, tuple[str, dict[str, Any]]] = {"local": (str(base / "store"), {})}
        if any("s3" in row for row in wanted):
            stores["s3"] = _s3_store(args, stack)
        from ckptstore import CheckpointStore

        for name in {s for s, _ in wanted if s in stores}:  # the stores rows read from
            uri, options = stores[name]
            with CheckpointStore(uri, storage_options=options) as store:
                store.push_dir(1, step)
        for source, dest in wanted:
            uri, options = stores[source]
            out = str(base / f"out-{source}-{dest}")
            if dest == "s3":
                out = f"{stores['s3'][0]}-exports/{uuid.uuid4().hex[:8]}"
            spec = {
                "row": f"export {source} -> {dest}",
                "uri": uri,
                "options": options,
                "out": out,
                "out_options": stores["s3"][1] if dest == "s3" else None,
                "shard_size": shard_size,
                "config": config,
            }
            rows.append(spec | _run(spec, base))
        if args.merger:
            out = str(base / "out-merger")
            spec = {"row": "merger", "local_dir": str(step / "actor"), "out": out}
            spec |= {"config": config}
            rows.append(spec | _run(spec, base))
    print(table(rows, model_bytes, bound, args))
    if args.json:
        args.json.write_text(json.dumps({"model_bytes": model_bytes, "bound": bound, "rows": rows}))
    return 0 if all(r.get("ok") for r in rows) else 1


def _s3_store(args: argparse.Namespace, stack: ExitStack) -> tuple[str, dict[str, Any]]:
    prefix = f"s3://{args.bucket}/bench-{uuid.uuid4().hex[:8]}"
    if args.endpoint_url:
        return prefix, {"endpoint_url": args.endpoint_url}
    from ckptstore.testing.s3server import LocalS3Server

    server = stack.enter_context(LocalS3Server())
    server.create_bucket(args.bucket)
    return prefix, server.storage_options()


def _run(spec: dict[str, Any], base: Path) -> dict[str, Any]:
    spec_path, result_path = base / "spec.json", base / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(HERE)]))
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, __file__, "--worker", str(spec_path), str(result_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not result_path.exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"exited {proc.returncode}: {tail[:300]}"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["ok"] = result["mismatches"] == 0
    return result


def table(
    rows: list[dict[str, Any]], model_bytes: int, bound: int, args: argparse.Namespace
) -> str:
    lines = [
        f"model: {model_bytes / MiB:.0f} MiB fp32 on {args.world} ranks; output shards of "
        f"{args.shard_size_mb} MiB; bound: the largest shard's tensors, {bound / MiB:.0f} MiB",
        "",
        f"{'row':<24}{'s':>8}{'MB/s':>9}{'extra RSS MiB':>15}{'vs bound':>10}{'read/model':>12}"
        f"{'bits':>7}",
    ]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"{r['row']:<24}  failed: {r.get('error')}")
            continue
        speed = model_bytes / 1e6 / max(r["seconds"], 1e-9)
        read = f"{r['bytes_read'] / model_bytes:.2f}" if "bytes_read" in r else "-"
        bits = "equal" if r["mismatches"] == 0 else f"{r['mismatches']} differ"
        lines.append(
            f"{r['row']:<24}{r['seconds']:>8.2f}{speed:>9.0f}{r['extra_rss'] / MiB:>15.0f}"
            f"{r['extra_rss'] / bound:>10.2f}{read:>12}{bits:>7}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
