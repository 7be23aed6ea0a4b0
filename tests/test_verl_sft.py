"""verl's SFT trainer on a store (ckptstore.integrations.verl_sft).

The rules of which rank owns which file run on plain listings. ``test_real_verl_sft_*`` runs
verl 0.9.1's own SFT trainer (``SFTTrainer.fit``, its FSDP2 engine and ``CheckpointHandler``)
on two gloo ranks under torchrun, on CPU (verl_cpu.py says how), with a tiny Llama, saving to a
real S3 server (moto on 127.0.0.1): a job commits step 2, trains step 3 and is killed with
SIGKILL; a fresh job with empty local directories resumes from the URI alone, and its state
before and after step 3 is compared bit for bit with the killed job's. Its last step is then
exported to Hugging Face (the SFT step's top level is its role) and resumed by a job of one
rank, resharded: the gathered 2-rank state, bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.cli.main import run
from ckptstore.errors import ConfigError, IncompleteCheckpointError
from ckptstore.integrations.verl_reshard import reshard_from_store
from ckptstore.integrations.verl_sft_files import (
    RankFiles,
    check_sft_complete,
    include_patterns,
    saved_world_size,
)
from ckptstore.integrations.verl_steps import assign_files, role_folder
from export_checks import assert_bits, exported

HAVE_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(
    not HAVE_VERL, reason="verl is not installed (pip install 'ckptstore[verl]'; CI installs it)"
)
TESTS = Path(__file__).parent
SHARED = ["fsdp_config.json", "huggingface/config.json", "huggingface/tokenizer.json"]


def step_files(rank: int, world: int = 2) -> list[str]:
    return [f"{k}_world_size_{world}_rank_{rank}.pt" for k in ("model", "optim", "extra_state")]


# -- which rank owns what ------------------------------------------------------------------


def test_each_rank_offers_its_own_files_and_the_shared_ones_never_another_ranks() -> None:
    everything = [(p, 10) for r in range(2) for p in step_files(r)]
    everything += [("data_0.pt", 5), ("data_1.pt", 5)] + [(p, 3) for p in SHARED]
    one = RankFiles(1, 2, "data_1.pt")
    offered = [p for p, _ in one.offers(everything)]  # shared storage: rank 1 sees it all
    assert sorted(offered) == sorted([*step_files(1), "data_1.pt", *SHARED])
    stale = RankFiles(0, 2, "data_0.pt").owner("model_world_size_4_rank_0.pt")
    assert stale is False  # a leftover of another world size is nobody's to upload


def test_without_shared_storage_every_rank_uploads_its_own_and_rank0_the_shared() -> None:
    held = {  # two nodes: rank 0 wrote huggingface/ and fsdp_config.json, rank 1 only its own
        "0": RankFiles(0, 2, "data_0.pt").offers(
            [(p, 10) for p in step_files(0)] + [("data_0.pt", 5)] + [(p, 3) for p in SHARED]
        ),
        "1": RankFiles(1, 2, "data_1.pt").offers(
            [(p, 10) for p in step_files(1)] + [("data_1.pt", 5)]
        ),
    }
    shares = assign_files(held, 2)
    assert sorted(shares["1"]) == sorted([*step_files(1), "data_1.pt"])
    assert sorted(shares["0"]) == sorted([*step_files(0), "data_0.pt", *SHARED])


def test_a_rank_pulls_its_own_files_and_the_shared_ones_only_for_its_node() -> None:
    paths = [*step_files(0), *step_files(1), "data_0.pt", "data_1.pt", *SHARED]
    rank1 = RankFiles(1, 2, "data_1.pt")
    assert sorted(rank1.pulls(paths, shared=False)) == sorted([*step_files(1), "data_1.pt"])
    assert sorted(rank1.pulls(paths, shared=True)) == sorted([*step_files(1), "data_1.pt", *SHARED])
    seq_parallel_peer = RankFiles(1, 2, None)  # outputs no data: pulls no data_D.pt
    assert "data_1.pt" not in seq_parallel_peer.pulls(paths, shared=False)


def test_include_patterns_take_names_with_glob_characters_literally() -> None:
    import fnmatch

    (pattern,) = include_patterns(["huggingface/a[1]*.json"])
    assert fnmatch.fnmatchcase("huggingface/a[1]*.json", pattern)
    assert not fnmatch.fnmatchcase("huggingface/a1x.json", pattern)


@pytest.mark.parametrize(
    ("drop", "says"),
    [
        ("model_world_size_2_rank_1.pt", "missing for rank(s) 1"),
        ("optim_world_size_2_rank_0.pt", "missing for rank(s) 0"),
        ("data_1.pt", "data_1.pt was found on no rank"),
    ],
)
def test_a_step_missing_a_ranks_file_is_refused(drop: str, says: str) -> None:
    paths = [*step_files(0), *step_files(1), "data_0.pt", "data_1.pt", *SHARED]
    check_sft_complete(paths, 4, ["data_0.pt", "data_1.pt"])
    with pytest.raises(IncompleteCheckpointError, match=re.escape(says)):
        check_sft_complete([p for p in paths if p != drop], 4, ["data_0.pt", "data_1.pt"])


def test_a_step_without_model_files_is_refused_and_a_ppo_step_is_not_an_sft_step() -> None:
    with pytest.raises(IncompleteCheckpointError, match=r"no model_world_size_W_rank_R\.pt"):
        check_sft_complete(["data_0.pt", *SHARED], 4, ["data_0.pt"])
    assert saved_world_size(["actor/model_world_size_2_rank_0.pt", "data.pt"]) is None
    assert saved_world_size([*step_files(0, 4), "data_0.pt"]) == 4


def test_an_sft_steps_role_is_its_top_level_and_it_has_no_other_role() -> None:
    """The one rule by which the export (and the signed export's pull) finds a step's model:
    role folders in a PPO step, the top level in an SFT step."""
    sft = [*step_files(0), *step_files(1), "data_0.pt", *SHARED]
    ppo = [f"actor/{p}" for p in step_files(0)] + [f"critic/{p}" for p in step_files(0)]
    assert role_folder(sft) == "" and role_folder(sft, "") == ""
    assert role_folder(ppo) == "actor" and role_folder(ppo, "critic") == "critic"
    assert role_folder(["state.json", ".metadata"], "critic") == "critic"  # no verl files
    with pytest.raises(ConfigError, match=r"a verl SFT step.*no role 'critic'"):
        role_folder(sft, "critic")


def loader_state(samples: int, steps: int) -> dict[str, Any]:
    """A StatefulDataLoader's state as verl's SFT trainer saves it (num_workers=0)."""
    return {"_index_sampler_state": None, "_sampler_iter_state": {"samples_yielded": samples},
            "_sampler_iter_yielded": steps, "_num_yielded": steps, "fetcher_state": None,
            "dataset_state": None, "_iterator_finished": False}  # fmt: skip


class Custom:
    """A sampler state the reshard cannot know how to split."""


@pytest.mark.parametrize(
    ("saved", "ranks", "says"),
    [
        ([loader_state(6, 3)] * 2, 3, None),  # 12 samples: 4 on each of 3 ranks
        ([loader_state(3, 3)] * 2, 4, "6 samples consumed over 2 ranks do not split evenly"),
        ([loader_state(6, 3) | {"dataset_state": Custom()}] * 2, 1, "beyond plain values"),
    ],
)
def test_sft_dataloader_states_split_over_another_number_of_ranks_or_are_refused(
    tmp_path: Path, saved: list[dict[str, Any]], ranks: int, says: str | None
) -> None:
    import torch

    from ckptstore.errors import CompatibilityError
    from ckptstore.integrations.verl_reshard_files import reshard_loaders

    paths = []
    for rank, state in enumerate(saved):
        torch.save(state, tmp_path / f"in-{rank}.pt")
        paths.append(tmp_path / f"in-{rank}.pt")
    out = tmp_path / "out"
    out.mkdir()
    if says is not None:
        with pytest.raises(CompatibilityError, match=says):
            reshard_loaders(paths, out, ranks)
        return
    reshard_loaders(paths, out, ranks)
    states = [torch.load(out / f"data_{d}.pt") for d in range(ranks)]
    assert states == [loader_state(4, 3)] * ranks and not (out / f"data_{ranks}.pt").exists()


def test_store_options_with_retention_survive_dataclasses_replace() -> None:
    """Every rank but 0 opens the store with the section's options, lease off: replace() of
    options with a retention key once failed (a function default came back bound)."""
    import dataclasses

    from ckptstore.options import VERL, StoreOptions

    options = StoreOptions.from_mapping({"keep_last": 2}, spelling=VERL)
    quiet = dataclasses.replace(options, lease=False, takeover=False)
    assert (quiet.keep_last, quiet.lease) == (2, False)
    with pytest.raises(ConfigError, match="keep_last"):
        dataclasses.replace(options, keep_last=0)


@needs_verl
@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"default_hdfs_dir": "hdfs://nn/sft"}, "set trainer.default_hdfs_dir=null"),
        ({"mode": "ray"}, "the Ray SFT trainer is not supported"),
        ({"upload": "driver"}, "every rank uploads its own files"),
    ],
)
def test_the_sft_handler_refuses_what_would_not_store_every_ranks_files(
    tmp_path: Path, given: dict[str, Any], says: str
) -> None:
    from verl.utils.checkpoint import OrchestrationMode

    from ckptstore.integrations.verl_config import VerlStoreConfig
    from ckptstore.integrations.verl_sft import StoreCheckpointHandler

    section = {
        "uri": str(tmp_path / "store"),
        **({"upload": "driver"} if "upload" in given else {}),
    }
    settings = VerlStoreConfig.from_verl({"trainer": {"ckptstore": section}})
    kwargs: dict[str, Any] = {"default_local_dir": str(tmp_path / "ckpt")}
    if "default_hdfs_dir" in given:
        kwargs["default_hdfs_dir"] = given["default_hdfs_dir"]
    if "mode" in given:
        kwargs["mode"] = OrchestrationMode.RAY
    with pytest.raises(ConfigError, match=says):
        StoreCheckpointHandler(None, None, settings=settings, **kwargs)
    assert not (tmp_path / "store").exists()  # refused before the store was opened


@needs_verl
def test_the_entry_point_composes_verls_sft_config_with_the_store_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m ckptstore.integrations.verl_sft`` is Hydra's main over verl's own
    ``sft_trainer_engine`` config (``--cfg job`` prints it and stops before training). The
    module runs as ``__main__`` in this process (``runpy``, what ``python -m`` does) with the
    command line ``python -m`` would hand it, without an interpreter that imports verl again."""
    import runpy

    from omegaconf import OmegaConf

    from ckptstore.integrations import verl_sft

    store = tmp_path / "store"
    args = [f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=7",
            f"+trainer.ckptstore.uri={store}", "+trainer.ckptstore.keep_last=2"]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [verl_sft.__file__, "--cfg", "job", *args])
    capsys.readouterr()
    with warnings.catch_warnings():  # runpy: the module is imported already (its imports are)
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module(verl_sft.__name__, run_name="__main__", alter_sys=True)
    config = OmegaConf.create(capsys.readouterr().out)
    assert config.trainer.save_freq == 7 and config.trainer.default_hdfs_dir is None
    assert config.engine.strategy == "fsdp" and config.data.train_batch_size == 256  # verl's
    assert OmegaConf.to_container(config.trainer.ckptstore) == {
        "uri": str(tmp_path / "store"), "keep_last": 2,
    }  # fmt: skip
    assert os.listdir(tmp_path) == []  # it stopped before training: nothing written


@needs_verl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_handler_persists_every_kth_save_refuses_a_lost_rank_file_and_resumes_locally(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """verl's CheckpointHandler as StoreCheckpointHandler on two gloo ranks (an engine that
    writes verl's files stands in for the model; verl_sft_handler_ranks.py): ``persist_every``,
    a save that lost a rank's file commits nothing while training goes on, ``max_failed_saves``
    in a row stop every rank, and a resume prefers a local step every rank holds whole."""
    from verl_launch import launch
    from verl_sft_handler_ranks import run_rank

    launch(run_rank, 2, str(tmp_path), s3_uri, s3_options)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["start"] == 0  # an empty store: from step 0
        # saves 1-7: every 2nd is due; 4 lost rank 1's file (refused, training went on), so
        # 5 was due at once; 7 lost it again, and 8 too: two failures in a row stop the job
        assert result["committed"] == [[], [2], [2], [2], [2, 5], [2, 5], [2, 5]]
        assert result["stopped"][0] == 8 and "2 verl SFT saves in a row" in result["stopped"][1]
        assert "model_world_size_2_rank_R.pt is missing for rank(s) 1" in result["stopped"][1]
        assert result["second"] == [5, 5, ["global_step_5"]]  # pulled: rank 1 lacked step 8
        assert result["third"] == [5, None, ["global_step_5"]]  # local, as new as the store
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as store:
        assert [i.step for i in store.list()] == [2, 5]
        assert all(store.verify(i.step).ok for i in store.list())


# -- the real trainer --------------------------------------------------------------------


def save_sft_model(path: Path) -> None:
    """A one-layer Llama with weights, a word-level tokenizer with a chat template: what verl's
    SFT trainer loads (``architectures`` for its model config, the template for its dataset)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


def save_sft_data(path: Path) -> None:
    import pandas as pd

    rows = [
        {"messages": [
            {"role": "user", "content": f"w{i % 60} w{(i * 3) % 60}"},
            {"role": "assistant", "content": f"w{(i * 7) % 60} w{(i + 5) % 60} w{i % 13}"},
        ]}
        for i in range(32)
    ]  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


def overrides(root: Path, uri: str, options: dict[str, Any]) -> list[str]:
    """verl's SFT config for two CPU ranks and a tiny model; the store under trainer.ckptstore."""
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'train.parquet'}",
        "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "data.max_length=32",
        "data.num_workers=0", "data.use_dynamic_bsz=False",
        "+model.override_config.attn_implementation=eager", "model.use_remove_padding=False",
        "model.enable_gradient_checkpointing=False",
        "engine.strategy=fsdp2", "engine.use_torch_compile=False",
        "trainer.device=cpu", "trainer.logger=[console]", "trainer.total_training_steps=4",
        "trainer.save_freq=1", "trainer.project_name=tiny-sft", "trainer.experiment_name=gloo",
        f"+trainer.ckptstore.uri={uri}",
        "+trainer.ckptstore.keep_last=3",
        *(f"+trainer.ckptstore.storage_options.{k}={v}" for k, v in options.items()),
    ]  # fmt: skip


def torchrun(
    root: Path, job: str, kill_at: int, args: list[str], nproc: int = 2
) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(Path(ckptstore.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(TESTS)]),
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(port),
        str(TESTS / "verl_sft_ranks.py"), str(root), job, str(kill_at), *args,
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


def recorded(root: Path, job: str, tag: str, rank: int) -> dict[str, Any]:
    import torch

    return torch.load(root / job / f"{tag}-rank{rank}.pt", weights_only=False)


def gathered(root: Path, job: str, tag: str, world: int = 2) -> dict[str, Any]:
    """The full model and optimizer state recorded at ``tag``: FSDP2 shards every tensor
    ``Shard(0)`` in rank order, so a full tensor is its ranks' shards concatenated; what is
    not sharded (0-d step counters, param_groups) must agree on every rank."""
    import torch

    def join(values: list[Any], where: str) -> Any:
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            return torch.cat(values)
        if isinstance(first, dict):
            return {k: join([v[k] for v in values], f"{where}.{k}") for k in first}
        if isinstance(first, list):
            return [join([v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]
        for value in values[1:]:
            assert_same(first, value, where)
        return first

    states = [recorded(root, job, tag, rank) for rank in range(world)]
    return {key: join([s[key] for s in states], key) for key in ("model", "optim")}


def assert_same(a: Any, b: Any, where: str) -> None:
    """Bit-identical, tensors included (equal values, dtypes and shapes)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, type(a)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@needs_verl
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_real_verl_sft_saves_every_ranks_share_killed_then_resumes_from_the_uri_bit_identical(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    save_sft_model(tmp_path / "model")
    save_sft_data(tmp_path / "train.parquet")
    args = overrides(tmp_path, s3_uri, s3_options)

    # 1. Train, commit steps 1 and 2 (save_freq=1), train step 3, then SIGKILL on every rank.
    killed = torchrun(tmp_path, "a", 3, args)
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert not list((tmp_path / "a").glob("done-*")), "the first job was not killed"
    for rank in range(2):
        assert (tmp_path / "a" / f"post-3-rank{rank}.pt").is_file(), killed.stderr[-4000:]
    store = CheckpointStore(s3_uri, storage_options=s3_options, lease=False)
    assert [i.step for i in store.list()] == [1, 2]
    info = store.info(2)
    names = {f.path for f in info.files}
    every = {*step_files(0), *step_files(1), "data_0.pt", "data_1.pt", "fsdp_config.json"}
    assert every <= names and any(n.startswith("huggingface/") for n in names), sorted(names)
    assert info.metadata["trainer"] == "sft" and info.metadata["global_step"] == 2
    tracker = tmp_path / "a" / "node1" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text() == "2"  # verl writes it on rank 0's node; rank 1's has it too
    # rank 1 wrote its files into node1 only: rank 0 could not have uploaded them
    assert not (
        tmp_path / "a" / "node0" / "global_step_2" / "model_world_size_2_rank_1.pt"
    ).exists()
    # rot one byte of rank 1's model shard of step 2 in the bucket
    (entry,) = [f for f in info.files if f.path == "model_world_size_2_rank_1.pt"]
    key = f"{s3_uri.split('/', 3)[3]}/{entry.key(2)}"
    body = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))

    # 2. A fresh job, empty local directories: resumes from the URI alone, from step 1 (step 2
    # fails verification on rank 1, so on every rank), saves step 2 again in its place and goes
    # on to step 4, through a local tier (both ranks' node) whose steps reach S3 behind.
    tier = f"+trainer.ckptstore.local={tmp_path / 'b' / 'tier'}"
    resumed = torchrun(tmp_path, "b", 0, [*args, tier])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-4000:]
    for rank in range(2):
        assert recorded(tmp_path, "b", "pre-2", rank)["resumed"] == 1
        # model shards, optimizer, lr scheduler and the batch of each step (the dataloader's
        # position) are those of the job that was not interrupted, before and after each step
        for tag in ("pre-2", "post-2", "pre-3", "post-3"):
            mine = recorded(tmp_path, "b", tag, rank)
            assert_same(
                mine, {**recorded(tmp_path, "a", tag, rank), "resumed": 1}, f"{tag} r{rank}"
            )
        with pytest.raises(AssertionError):  # the states compared do change from step to step
            assert_same(recorded(tmp_path, "a", "pre-2", rank), mine, "a step earlier")
        assert not (tmp_path / "b" / f"pre-1-rank{rank}.pt").exists()  # no step trained twice
        assert (tmp_path / "b" / f"post-4-rank{rank}.pt").is_file()
    # each rank pulled its own files; the shared ones once per node directory
    node1 = tmp_path / "b" / "node1" / "global_step_1"
    assert not (node1 / "model_world_size_2_rank_0.pt").exists()
    assert (node1 / "model_world_size_2_rank_1.pt").is_file() and (node1 / "data_1.pt").is_file()
    assert (node1 / "fsdp_config.json").is_file()
    store.reload()
    assert [i.step for i in store.list()] == [2, 3, 4]  # keep_last=3; step 2 replaced
    store.pull_dir(tmp_path / "step2", step=2, fallback=False)  # verifies every byte
    assert (tmp_path / "b" / "tier" / "global_step_4").is_dir()

    # 3. An SFT step's top level is its role: exported to Hugging Face from the URI, it is the
    # trained model's full state dict, bit for bit, with verl's config and tokenizer
    full = gathered(tmp_path, "b", "post-4")
    out = tmp_path / "hf"
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    assert run(["export", s3_uri, "4", str(out), *endpoint]) == 0
    assert_bits(exported(out), full["model"])
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(out)
    assert_bits(loaded.state_dict(), full["model"])
    # ... and resharded for another world size: 2 ranks consumed 2 x 8 samples, which 4 ranks
    # split 4 x 4 (a DistributedSampler takes rank r's positions r, r+D, ... of one permutation)
    done = reshard_from_store(store, 4, tmp_path / "w4", 4)
    assert (done.source_world_size, done.world_size, done.folders) == (2, 4, (".",))
    loaders = [torch.load(tmp_path / "w4" / f"data_{d}.pt") for d in range(4)]
    assert [s["_sampler_iter_state"]["samples_yielded"] for s in loaders] == [4, 4, 4, 4]
    assert [s["_num_yielded"] for s in loaders] == [4, 4, 4, 4]  # steps stay steps

    # 4. The same step resumed by a job of ONE rank: pulled whole, resharded for it before
    # verl loads; model, optimizer, lr scheduler and data position are the 2-rank job's
    one = [a for a in args if not a.startswith("trainer.total_training_steps=")]
    single = torchrun(tmp_path, "c", 0, [*one, "trainer.total_training_steps=5"], nproc=1)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-4000:]
    mine = recorded(tmp_path, "c", "pre-5", 0)
    assert mine["resumed"] == 4
    assert_same({"model": mine["model"], "optim": mine["optim"]}, full, "1 rank vs 2")
    before = recorded(tmp_path, "b", "post-4", 0)
    assert_same(mine["sched"], before["sched"], "sched")
    # 16 samples consumed, then step 5's 4: the one rank skips exactly the samples seen
    loader = before["loader"] | {"_num_yielded": 5, "_sampler_iter_yielded": 5}
    assert_same(mine["loader"], loader | {"_sampler_iter_state": {"samples_yielded": 20}}, "data")
    assert (tmp_path / "c" / "post-5-rank0.pt").is_file()
    store.reload()
    assert "model_world_size_1_rank_0.pt" in {f.path for f in store.info(5).files}
