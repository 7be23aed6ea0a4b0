"""Exporting committed steps as Hugging Face models: what is written, what is checked, what is
refused, and following a run with ``wait``.

Steps here are laid out as verl's FSDP2 save writes them (DTensor ``Shard(0)`` on a 1-D mesh,
``torch.chunk``'s uneven rows, plain replicated buffers), by DCP through CkptStoreWriter, and
by ``store.save``, without a process group; test_export_verl.py runs verl's own checkpoint
manager. Every comparison is bit for bit (``torch.equal`` and dtype).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from safetensors.torch import load_file

from ckptstore import CheckpointStore, WaitTimeoutError
from ckptstore.cli.main import run
from ckptstore.errors import ConfigError, ConflictError, CorruptCheckpointError
from ckptstore.export import export_hf
from ckptstore.export.ledger import Ledger, crc32c_combine
from ckptstore.export.plan import Aliases, KeyMap, OutTensor, SourceTensor, drop_tied, plan_shards
from ckptstore.replication.follow import wait_for_step
from export_checks import assert_bits, exported, leftovers
from verl_reshard_steps import full_state, mesh, shard

ROOT = Path(__file__).resolve().parent.parent
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def fsdp2_model_step(
    root: Path,
    world: int,
    params: dict[str, torch.Tensor],
    *,
    buffers: dict[str, torch.Tensor] | None = None,
    aliases: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """``global_step_1``'s model files as FSDP2 on ``world`` ranks saves them: parameters as
    DTensor shards, buffers as plain tensors on every rank, ``aliases`` (name -> name) sharing
    a parameter as tied weights do."""
    folder = root / "actor"
    (folder / "huggingface").mkdir(parents=True)
    for rank in range(world):
        on = mesh(world, rank)
        state: dict[str, torch.Tensor] = {n: shard(p, world, rank, on) for n, p in params.items()}
        for alias, name in (aliases or {}).items():
            state[alias] = state[name]
        state |= {n: b.clone() for n, b in (buffers or {}).items()}
        torch.save(state, folder / f"model_world_size_{world}_rank_{rank}.pt")
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    (folder / "huggingface" / "config.json").write_text(json.dumps(config or LLAMA))
    (folder / "huggingface" / "tokenizer.json").write_text('{"version": "1.0"}')
    return root


def committed(tmp_path: Path, step_dir: Path, **options: Any) -> CheckpointStore:
    store = CheckpointStore(str(tmp_path / "store"), **options)
    store.push_dir(1, step_dir)
    return store


# -- the checksum of ranges read out of order ----------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_crc32c_of_pieces_combines_into_the_crc_of_the_whole(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(1, 5000))
    cuts = sorted(rng.sample(range(1, len(data)), min(4, len(data) - 1))) if len(data) > 1 else []
    crc = 0
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        crc = crc32c_combine(crc, crc32c.crc32c(data[a:b]), b - a)
    assert crc == crc32c.crc32c(data)


def _ledger(data: bytes, crc: int | None = None) -> Ledger:
    value = crc32c.crc32c(data) if crc is None else crc
    return Ledger(len(data), f"{value:08x}", where="mem://f", step=1, path="f")


def _reader(data: bytes) -> Any:
    def read(a: int, b: int) -> Any:
        yield data[a:b]

    return read


def test_the_ledger_reads_the_gaps_and_checks_overlapping_reads() -> None:
    data = random.Random(1).randbytes(10_000)
    ledger = _ledger(data)
    for a, b in [(100, 900), (100, 900), (800, 1200), (5000, 6000), (9990, 10_000)]:
        ledger.record(a, data[a:b])
    # gaps 0..100, 1200..5000, 6000..9990; the overlapping 100..1200 read again as one span
    assert ledger.finish(_reader(data)) == 100 + 3800 + 3990 + 1100


def test_the_ledger_refuses_what_does_not_add_up() -> None:
    data = random.Random(2).randbytes(4096)
    changed = bytearray(data)
    changed[3000] ^= 1
    ledger = _ledger(data)
    ledger.record(0, data[:2000])
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ledger.finish(_reader(bytes(changed)))  # the unread rest differs from the manifest
    twice = _ledger(data)
    twice.record(0, data[:100])
    twice.record(0, changed[:99] + b"\0")
    with pytest.raises(CorruptCheckpointError, match="differ between two reads"):
        twice.finish(_reader(data))
    short = _ledger(data)
    with pytest.raises(CorruptCheckpointError, match="shorter"):
        short.finish(_reader(data[:4000]))


# -- the plan's rules, as values ---------------------------------------------------------------


def test_key_prefix_maps_rename_and_select() -> None:
    assert KeyMap.parse(None).apply("model.x") == "model.x"
    rules = KeyMap.parse(["model.=", "module.=model."])
    assert rules.apply("model.layers.0.w") == "layers.0.w"
    assert rules.apply("module.norm") == "model.norm"
    assert rules.apply("optim.state.0") is None
    with pytest.raises(ConfigError, match="OLD=NEW"):
        KeyMap.parse(["model."])


def _out(name: str, nbytes: int) -> OutTensor:
    tensor = SourceTensor(name, torch.uint8, (nbytes,), ())
    return OutTensor(name, torch.uint8, tensor)


def test_shards_are_cut_in_order_and_a_big_tensor_gets_its_own() -> None:
    shards = plan_shards([_out("a", 40), _out("b", 50), _out("big", 300), _out("c", 10)], 100)
    assert [s.path for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [[t.name for t in s.tensors] for s in shards] == [["a", "b"], ["big"], ["c"]]


def test_tied_aliases_are_dropped_unless_the_config_unties_them() -> None:
    aliases = Aliases({"embed": ["embed", "lm_head"]})
    names = ["embed", "norm", "lm_head"]
    assert drop_tied(names, aliases, True) == {"lm_head": "embed"}
    assert drop_tied(names, aliases, None) == {"lm_head": "embed"}
    assert drop_tied(names, aliases, False) == {}


# -- verl FSDP2 steps ---------------------------------------------------------------------------


def model_params() -> dict[str, torch.Tensor]:
    """Rows that 2, 3 and 5 ranks split unevenly, some fewer rows than ranks, one bf16."""
    return full_state()


BUFFERS = {"model.steps_seen": torch.tensor(7), "model.layers.0.scale": torch.full((1,), 0.5)}


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_fsdp2_steps_export_bit_exact_buffers_taken_once(tmp_path: Path, world: int) -> None:
    params = model_params()
    step = fsdp2_model_step(tmp_path / "step", world, params, buffers=BUFFERS)
    store = committed(tmp_path, step)
    report = export_hf(store, 1, tmp_path / "out")
    assert_bits(exported(tmp_path / "out"), params | BUFFERS)  # 0-d stays 0-d, (1,) stays (1,)
    assert (report.kind, report.world_size, report.skipped) == ("verl", world, False)
    assert report.tensor_bytes == sum(t.nbytes for t in (params | BUFFERS).values())
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert leftovers(tmp_path) == []


def test_a_single_rank_save_of_plain_tensors_without_fsdp_config(tmp_path: Path) -> None:
    """verl#903 (single-GPU saves hold plain tensors) and verl#2252 (no fsdp_config.json)."""
    params = model_params() | BUFFERS
    actor = tmp_path / "step" / "actor"
    actor.mkdir(parents=True)
    torch.save(params, actor / "model_world_size_1_rank_0.pt")
    export_hf(committed(tmp_path, tmp_path / "step"), 1, tmp_path / "out")
    assert_bits(exported(tmp_path / "out"), params)


def test_dtypes_change_only_when_asked(tmp_path: Path) -> None:
    params = model_params()
    store = committed(tmp_path, fsdp2_model_step(tmp_path / "s", 3, params, buffers=BUFFERS))
    export_hf(store, 1, tmp_path / "fp16", dtype="fp16", shard_size=100)
    got = exported(tmp_path / "fp16")
    everything = params | BUFFERS  # floating-point buffers too; the int64 one stays
    assert_bits(
        got, {n: t.to(torch.float16) if t.is_floating_point() else t for n, t in everything.items()}
    )
    shards = sorted(p.name for p in (tmp_path / "fp16").glob("model-*.safetensors"))
    assert len(shards) == 4  # embed (2048 B) | q, norm, tiny (68 B) | head (156 B) | buffers
    config = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert config["torch_dtype"] == "float16"


@pytest.mark.parametrize("tied", [True, False])
def test_tied_weights_are_written_once_as_hugging_face_ties_them(
    tmp_path: Path, tied: bool
) -> None:
    params = {"model.embed_tokens.weight": torch.randn(11, 4), "model.norm.weight": torch.ones(4)}
    config = LLAMA | {"tie_word_embeddings": tied}
    step = fsdp2_model_step(
        tmp_path / "s",
        2,
        params,
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
        config=config,
    )
    report = export_hf(committed(tmp_path, step), 1, tmp_path / "out")
    got = exported(tmp_path / "out")
    if tied:
        assert_bits(got, params)
        assert any("lm_head.weight is tied" in note for note in report.notes)
    else:
        assert_bits(got, params | {"lm_head.weight": params["model.embed_tokens.weight"]})


def test_a_buffer_that_differs_between_ranks_is_refused(tmp_path: Path) -> None:
    step = fsdp2_model_step(tmp_path / "s", 2, model_params(), buffers=BUFFERS)
    rank1 = step / "actor" / "model_world_size_2_rank_1.pt"
    state = torch.load(rank1, weights_only=False)
    state["model.layers.0.scale"] = torch.full((1,), 0.25)
    torch.save(state, rank1)
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.0\.scale.*differs"):
        export_hf(committed(tmp_path, step), 1, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def _payload(store: CheckpointStore, path: str) -> Path:
    entry = store.info(1).manifest.file(path)
    return Path(store.uri) / entry.key(1)


@pytest.mark.parametrize("where", ["tensor", "unread record"])
def test_a_corrupt_byte_anywhere_in_a_read_file_fails_the_export(
    tmp_path: Path, where: str
) -> None:
    store = committed(tmp_path, fsdp2_model_step(tmp_path / "s", 2, model_params()))
    target = _payload(store, "actor/model_world_size_2_rank_1.pt")
    record = "data/0" if where == "tensor" else "/version"  # the pickle never reads "version"
    with zipfile.ZipFile(target) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record))
        offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data = bytearray(target.read_bytes())
    data[offset + (4 if where == "tensor" else 0)] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model_world_size_2_rank_1\.pt.*checksum"):
        export_hf(store, 1, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_second_export_is_skipped_and_another_refused(tmp_path: Path) -> None:
    store = committed(tmp_path, fsdp2_model_step(tmp_path / "s", 2, model_params()))
    first = export_hf(store, 1, tmp_path / "out")
    stamp = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    again = export_hf(store, 1, tmp_path / "out")
    assert again.skipped and again.files == first.files
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == stamp
    with pytest.raises(ConflictError, match="other options"):
        export_hf(store, 1, tmp_path / "out", dtype="bf16")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConflictError, match="not an empty directory"):
        export_hf(store, 1, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_an_export_into_s3_appears_with_its_index_and_is_skipped_after(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    params = model_params()
    store = committed(tmp_path, fsdp2_model_step(tmp_path / "s", 3, params))
    out = f"{s3_uri}-models/step-1"
    report = export_hf(store, 1, out, shard_size=1000, storage_options=s3_options)
    prefix = "run-models/step-1/"
    keys = [
        o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)["Contents"]
    ]
    assert sorted(k.removeprefix(prefix) for k in keys) == sorted(report.files)
    local = tmp_path / "downloaded"
    local.mkdir()
    for key in keys:
        s3_client.download_file(s3_bucket, key, str(local / key.removeprefix(prefix)))
    assert_bits(exported(local), params)
    assert export_hf(store, 1, out, shard_size=1000, storage_options=s3_options).skipped
    # an export that died before its index: the next one writes it all again, then the index
    s3_client.delete_object(Bucket=s3_bucket, Key=prefix + "model.safetensors.index.json")
    again = export_hf(store, 1, out, shard_size=1000, storage_options=s3_options)
    assert not again.skipped and again.files == report.files


def lora_step(root: Path, *, base: bool, meta: dict[str, Any] | None) -> Path:
    """A PEFT model's state as verl saves it (with ``save_lora_only``: no base weights)."""
    g = torch.Generator().manual_seed(5)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    params = {
        f"{module}.lora_A.default.weight": torch.randn(2, 6, generator=g),
        f"{module}.lora_B.default.weight": torch.randn(6, 2, generator=g),
    }
    if base:
        params[f"{module}.base_layer.weight"] = torch.randn(6, 6, generator=g)
        params["base_model.model.model.norm.weight"] = torch.ones(6)
    step = fsdp2_model_step(root, 2, params)
    if meta is not None:
        (step / "actor" / "lora_train_meta.json").write_text(json.dumps(meta))
    return step


def test_a_lora_only_step_exports_its_adapter_and_refuses_a_merge(tmp_path: Path) -> None:
    step = lora_step(tmp_path / "s", base=False, meta={"r": 2, "lora_alpha": 4})
    store = committed(tmp_path, step)
    report = export_hf(store, 1, tmp_path / "out")
    assert report.lora == "adapter" and report.tensors == 2
    adapter = load_file(tmp_path / "out" / "lora_adapter" / "adapter_model.safetensors")
    assert sorted(adapter) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    with pytest.raises(ConfigError, match="save_lora_only"):
        export_hf(store, 1, tmp_path / "merged", merge_lora=True)
    assert not (tmp_path / "merged").exists()


def test_a_lora_merge_without_alpha_is_refused(tmp_path: Path) -> None:
    store = committed(tmp_path, lora_step(tmp_path / "s", base=True, meta=None))
    with pytest.raises(ConfigError, match="lora_alpha"):
        export_hf(store, 1, tmp_path / "merged", merge_lora=True)
    report = export_hf(store, 1, tmp_path / "out")  # the adapter and the base model are fine
    assert sorted(exported(tmp_path / "out")) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
    ]
    config = json.loads((tmp_path / "out" / "lora_adapter" / "adapter_config.json").read_text())
    assert config["lora_alpha"] is None and report.lora == "adapter"


# -- DCP and native steps ------------------------------------------------------------------------


def llama_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(13, 6, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(9, 6, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(6, generator=g),
        "lm_head.weight": torch.randn(13, 6, generator=g),
    }


def test_dcp_steps_export_their_model_keys(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import CkptStoreWriter

    model = llama_state()
    optim = {"state": {"0": {"exp_avg": torch.randn(13, 6)}}, "step": 5}
    store = CheckpointStore(str(tmp_path / "store"))
    dcp.save(
        {"model": model, "optim": optim}, storage_writer=CkptStoreWriter(store, 1), no_dist=True
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(LLAMA))
    report = export_hf(store, 1, tmp_path / "out", hf_config=hf)
    assert report.kind == "dcp"
    assert_bits(exported(tmp_path / "out"), model)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    export_hf(store, 1, tmp_path / "all", key_prefix_map=["model.=backbone.", "optim.="])
    got = exported(tmp_path / "all")
    assert "backbone.model.norm.weight" in got and "state.0.exp_avg" in got and len(got) == 5
    with pytest.raises(ConfigError, match="no tensor of step 1 is left"):
        export_hf(store, 1, tmp_path / "none", key_prefix_map=["encoder.="])


def test_native_steps_export_their_model(tmp_path: Path) -> None:
    model = llama_state()
    model["lm_head.weight"] = model["model.embed_tokens.weight"]  # tied: stored once
    store = CheckpointStore(str(tmp_path / "store"), shard_size=200)
    store.save(1, {"model": model, "optimizer": {"lr": 0.1, "m": torch.zeros(3)}})
    report = export_hf(store, 1, tmp_path / "out")
    assert report.kind == "native"
    assert any("no config.json" in note for note in report.notes)
    want = {n: t for n, t in model.items() if n != "lm_head.weight"}
    assert_bits(exported(tmp_path / "out"), want)


def test_a_signed_store_exports_from_a_verified_copy(tmp_path: Path) -> None:
    params = model_params()
    step = fsdp2_model_step(tmp_path / "s", 3, params)
    store = committed(tmp_path, step, signing_key="k" * 32)
    export_hf(store, 1, tmp_path / "out", dtype="bf16")
    assert_bits(exported(tmp_path / "out"), {n: t.to(torch.bfloat16) for n, t in params.items()})


# -- the command line --------------------------------------------------------------------------


def test_cli_export_show_and_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = committed(tmp_path, fsdp2_model_step(tmp_path / "s", 2, model_params()))
    out = tmp_path / "out"
    args = ["export", store.uri, "latest", str(out), "--dtype", "bf16", "--shard-size", "1KB"]
    assert run([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 1 and doc["kind"] == "verl" and doc["out"] == str(out)
    assert len([f for f in doc["files"] if f.startswith("model-")]) > 1
    assert run(args) == 0
    assert "already exported" in capsys.readouterr().out
    assert run(["show", store.uri, "1"]) == 0
    shown = capsys.readouterr().out
    assert "exports:" in shown and str(out) in shown and "bf16" in shown
    assert run(["ls", store.uri]) == 0
    assert f"exported: step 1 -> {out}" in capsys.readouterr().out
    assert run(["export", store.uri, "7", str(tmp_path / "x")]) == 3
    assert run(["export", store.uri, "1", str(out)]) == 5  # other options, same OUT
    assert run(["export", store.uri, "1", str(tmp_path / "y"), "--shard-size", "lots"]) == 2


# -- following a run -------------------------------------------------------------------------


def test_wait_backs_off_and_times_out_naming_the_store(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.save(2, {"x": torch.zeros(1)})
    now, pauses = [0.0], []

    def sleep(seconds: float) -> None:  # time passes only here; steps 3 and 5 come at 20 s
        pauses.append(seconds)
        now[0] += seconds
        if now[0] > 20 and len(store.list()) == 1:
            store.save(3, {"x": torch.zeros(1)})
            store.save(5, {"x": torch.zeros(1)})

    found = wait_for_step(store, 2, interval=2, max_interval=5, clock=lambda: now[0], sleep=sleep)
    assert found.step == 5
    assert pauses == [2, 3, 4.5, 5, 5, 5]
    pauses.clear()
    with pytest.raises(WaitTimeoutError, match=r"store: no step newer than 5 .* within 7 s") as e:
        wait_for_step(store, None, timeout=7, interval=2, clock=lambda: now[0], sleep=sleep)
    assert pauses == [2, 3, 2] and e.value.step == 5 and e.value.uri == store.uri


def test_wait_picks_up_a_step_committed_by_another_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as store:
        store.save(1, {"x": torch.zeros(2)})
    script = (
        "import time, torch\nfrom ckptstore import CheckpointStore\n"
        f"time.sleep(1)\nwith CheckpointStore({uri!r}) as s: s.save(2, {{'x': torch.ones(2)}})\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    writer = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        assert run(["wait", uri, "--newer-than", "1", "--timeout", "120", "--interval", "0.2"]) == 0
        assert capsys.readouterr().out.strip() == "2"
    finally:
        assert writer.wait(timeout=120) == 0
    assert run(["wait", uri, "--timeout", "0"]) == 3  # nothing newer than latest (2)
    assert "no step newer than 2" in capsys.readouterr().err
