"""verl 0.9.1's own checkpoints exported: FSDPCheckpointManager on FSDP2, gloo ranks on CPU.

A tiny Llama with a persistent 0-d int64 buffer and a (1,) float one is trained two steps and
saved by verl on 1, 2 and 3 ranks (3 with tied embeddings), and with a PEFT LoRA adapter on 2
(export_ranks.py). Each step's export holds exactly the tensors the ranks gathered
(``full_tensor()``), bit for bit, and the model loaded from it with
``AutoModelForCausalLM.from_pretrained`` (offline) gives the trained model's logits. verl's
``model_merger`` runs on the same steps; every way its output differs is asserted here and
explained in docs/verl.md ("Exporting a model"). The export to ``s3://`` is measured by the
export benchmark, run small: the extra memory stays under the largest output shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptstore import CheckpointStore
from ckptstore.export import export_hf
from export_checks import assert_bits, exported

ROOT = Path(__file__).resolve().parent.parent
STEPS = {"plain1": ("plain", 1), "plain2": ("plain", 2), "tied3": ("tied", 3), "lora2": ("lora", 2)}
HF_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<name>/global_step_1`` saved by verl, and ``<name>/full-<variant>.pt``, per STEPS."""
    import export_ranks as ranks
    from verl_launch import launch

    root = tmp_path_factory.mktemp("verl-export")
    for name, (variant, world) in STEPS.items():
        (root / name).mkdir()
        folder = root / name
        launch(ranks.save_rank, world, str(folder), str(folder / "global_step_1"), variant)
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def trained(steps: Path, name: str) -> dict[str, Any]:
    variant = STEPS[name][0]
    saved: dict[str, Any] = torch.load(steps / name / f"full-{variant}.pt", weights_only=True)
    return saved


def logits_of(model_dir: Path, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from export_ranks import INPUT

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=INPUT).logits
    return logits


def hf_dir(steps: Path, name: str) -> Path:
    return steps / name / "global_step_1" / "actor" / "huggingface"


@pytest.mark.parametrize("name", ["plain1", "plain2", "tied3"])
@pytest.mark.slow
def test_real_verl_steps_export_bit_exact_with_the_trained_logits(
    steps: Path, name: str, tmp_path: Path, s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """plain2 is read from S3 (moto over HTTP): ranged GETs, no download of the step."""
    on_s3 = name == "plain2"
    uri, options = (s3_uri, s3_options) if on_s3 else (str(tmp_path / "store"), {})
    with CheckpointStore(uri, storage_options=options) as store:
        store.push_dir(1, steps / name / "global_step_1")
        report = export_hf(store, 1, tmp_path / "out")
    full = trained(steps, name)
    want = dict(full["model"])
    if name == "tied3":  # one tensor under two names in verl's files: written once
        assert torch.equal(want.pop("lm_head.weight"), want["model.embed_tokens.weight"])
    assert_bits(exported(tmp_path / "out"), want)
    assert want["model.steps_seen"].shape == () and want["model.layers.0.scale"].shape == (1,)
    assert (report.world_size, report.kind) == (STEPS[name][1], "verl")
    torch.testing.assert_close(logits_of(tmp_path / "out"), full["logits"], rtol=0, atol=1e-6)
    for file in HF_FILES:
        assert (tmp_path / "out" / file).read_bytes() == (hf_dir(steps, name) / file).read_bytes()


def test_real_verl_lora_step_exports_the_adapter_and_merges_it(steps: Path, tmp_path: Path) -> None:
    from ckptstore.export.lora import hf_name

    full = trained(steps, "lora2")
    store = CheckpointStore(str(tmp_path / "store"))
    store.push_dir(1, steps / "lora2" / "global_step_1")
    assert export_hf(store, 1, tmp_path / "out").lora == "adapter"
    lora = {n: t for n, t in full["model"].items() if ".lora_" in n}
    base = {hf_name(n): t for n, t in full["model"].items() if n not in lora}
    assert_bits(exported(tmp_path / "out"), base)
    adapter = tmp_path / "out" / "lora_adapter"
    peft_names = {n.replace(".default", ""): t for n, t in lora.items()}  # PEFT's saved keys
    assert_bits(load_file(adapter / "adapter_model.safetensors"), peft_names)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    logits = logits_of(tmp_path / "out", adapter)
    torch.testing.assert_close(logits, full["logits"], rtol=0, atol=1e-6)

    assert export_hf(store, 1, tmp_path / "merged", merge_lora=True).lora == "merged"
    merged = exported(tmp_path / "merged")
    assert sorted(merged) == sorted(base) and not (tmp_path / "merged" / "lora_adapter").exists()
    for proj in ("q_proj", "v_proj"):
        module = f"base_model.model.model.layers.0.self_attn.{proj}"
        a, b = lora[f"{module}.lora_A.default.weight"], lora[f"{module}.lora_B.default.weight"]
        name = f"model.layers.0.self_attn.{proj}.weight"
        assert torch.equal(merged[name], base[name] + (b @ a) * (8 / 4))  # PEFT's merge
        assert not torch.equal(merged[name], base[name])
    logits = logits_of(tmp_path / "merged")
    torch.testing.assert_close(logits, full["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["plain2", "tied3"])
def test_verl_model_merger_on_the_same_step_and_how_it_differs(
    steps: Path, name: str, tmp_path: Path
) -> None:
    """What ``python -m verl.model_merger merge --backend fsdp`` writes, against the export;
    each difference is one of docs/verl.md's."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    actor = steps / name / "global_step_1" / "actor"
    merger = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(actor),
        target_dir=str(tmp_path / "merger"),
        hf_model_config_path=str(actor / "huggingface"),
    )
    FSDPModelMerger(merger).merge_and_save()
    store = CheckpointStore(str(tmp_path / "store"))
    store.push_dir(1, steps / name / "global_step_1")
    export_hf(store, 1, tmp_path / "ours")
    theirs, ours = load_file(tmp_path / "merger" / "model.safetensors"), exported(tmp_path / "ours")
    full = trained(steps, name)
    # the same tensors under the same names: buffers once (0.9.1 has the verl#7610 fix), the
    # tied lm_head dropped by both
    assert sorted(theirs) == sorted(ours)
    assert theirs["model.steps_seen"].shape == () and theirs["model.layers.0.scale"].shape == (1,)
    # 1. the merger casts every tensor to bf16, the int64 buffer too; the export keeps dtypes
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16}
    assert ours["model.steps_seen"].dtype == torch.int64
    for key, tensor in theirs.items():
        assert torch.equal(tensor, ours[key].to(torch.bfloat16)), key
    # 2. so the merger's model answers with bf16 rounding, the export's with the trained logits
    merger_error = (logits_of(tmp_path / "merger").float() - full["logits"]).abs().max()
    assert merger_error > 1e-4
    torch.testing.assert_close(logits_of(tmp_path / "ours"), full["logits"], rtol=0, atol=1e-6)
    # 3. config.json: bfloat16 there, the weights' float32 here
    assert json.loads((tmp_path / "merger" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["torch_dtype"] == "float32"
    # 4. the tokenizer is loaded and saved again there (its config gains loader keys); copied here
    step_tokenizer = json.loads((hf_dir(steps, name) / "tokenizer_config.json").read_text())
    merger_tokenizer = json.loads((tmp_path / "merger" / "tokenizer_config.json").read_text())
    assert merger_tokenizer != step_tokenizer and "is_local" in merger_tokenizer
    # 5. one model.safetensors there; model-00001-of-00001.safetensors with its index here
    assert not (tmp_path / "merger" / "model.safetensors.index.json").exists()
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
def test_an_export_to_s3_streams_within_the_memory_bound(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    """benchmarks/bench_export.py, small: a 128 MiB model on 4 ranks exported to S3 in 96 MiB
    shards, in a fresh process whose extra peak RSS must stay under the largest shard."""
    out = tmp_path / "bench.json"
    args = ["--size-mb", "128", "--shard-size-mb", "96", "--world", "4", "--rows", "local-s3"]
    args += ["--endpoint-url", s3_endpoint, "--bucket", s3_bucket, "--json", str(out)]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_export.py"),
            *args,
            "--tmpdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["row"] == "export local -> s3" and row["mismatches"] == 0
    assert result["bound"] < result["model_bytes"]  # two shards: the bound is not the model
    assert 0 < row["extra_rss"] <= result["bound"], (row["extra_rss"], result["bound"])
