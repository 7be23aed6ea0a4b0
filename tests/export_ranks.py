"""The rank side of test_export's real-verl steps: verl 0.9.1's FSDPCheckpointManager on FSDP2
(``fully_shard``), gloo ranks on CPU, as in the elastic-resume tests (verl_reshard_ranks).

:func:`save_rank` builds a tiny Llama with two persistent buffers (a 0-d int64 and a (1,)
float: the shapes verl#7610 concatenated), optionally with tied embeddings or a PEFT LoRA
adapter, trains it two steps, saves ``global_step_1/actor`` with verl's manager, and has rank 0
write what the test compares against: every tensor gathered whole (``full_tensor()``) and the
model's logits on a fixed input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

from verl_reshard_ranks import _init

VOCAB = 66
INPUT = torch.tensor([[1, 5, 9, 33, 64, 2, 17, 40]])
"""The fixed input whose logits an export must reproduce."""


def config(*, tied: bool, base: str = "") -> LlamaConfig:
    """Dimensions that 2 and 3 ranks split unevenly (66 rows, 36, 16 on 3 ranks); ``base`` is
    where the model "came from" (verl copies its generation_config.json from there)."""
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        name_or_path=base,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=36,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary, built offline."""
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    model = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")


def save_rank(rank: int, world: int, root: str, step_dir: str, variant: str) -> None:
    """``variant``: ``plain``, ``tied`` (tied embeddings) or ``lora`` (PEFT LoRA on q, v)."""
    _init(rank, world, root, f"export-{variant}-{world}")
    try:
        base = Path(root) / "base"
        if rank == 0:
            GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9).save_pretrained(base)
        torch.manual_seed(0)
        model: Any = LlamaForCausalLM(config(tied=variant == "tied", base=str(base)))
        model.model.register_buffer("steps_seen", torch.tensor(7), persistent=True)
        model.model.layers[0].register_buffer("scale", torch.full((1,), 0.5), persistent=True)
        if variant == "lora":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            model = get_peft_model(model, lora)
        layers = model.base_model.model.model.layers if variant == "lora" else model.model.layers
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))  # as verl's workers
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        for step in range(2):
            ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        FSDPCheckpointManager(model, opt, None, processing_class=tokenizer()).save_checkpoint(
            os.path.join(step_dir, "actor"), None, 1
        )
        with torch.no_grad():
            logits = model(input_ids=INPUT).logits
        full = {k: _full(v) for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"model": full, "logits": logits}, Path(root) / f"full-{variant}.pt")
    finally:
        dist.destroy_process_group()


def _full(value: Any) -> Any:
    """A state dict entry whole (a collective for DTensors: every rank calls it)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


__all__ = ["INPUT", "config", "save_rank"]
