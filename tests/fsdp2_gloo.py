"""FSDP2 on CPU, run by tests/test_train.py under `torchrun --nproc_per_node 2 tests/fsdp2_gloo.py WORKDIR TOKENIZER`.

accelerate turns FSDP into DDP on CPU, so this drives what `lex train` relies on under FSDP directly, over gloo:
a LEX model wrapped with torch's `fully_shard` (per decoder layer, then the root), sharded checkpoints written and
read with torch.distributed.checkpoint, and the final folder written by `lex.training.save_full_model` on every rank.

Writes to WORKDIR (rank 0): result.json (world size, uninterrupted and resumed losses), final/ (the folder under
test), reference.safetensors (the gathered in-memory weights, DTensor.full_tensor(), the independent reference).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configuration_lex import LexConfig  # noqa: E402
from lex.training import save_full_model  # noqa: E402
from modeling_lex import LexForCausalLM  # noqa: E402

STEPS, CHECKPOINT_AT, BATCH, LENGTH = 6, 3, 4, 16
CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=512,
              max_position_embeddings=LENGTH)


def sharded_model(seed: int) -> tuple[LexForCausalLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LexForCausalLM(LexConfig(**CONFIG))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def step(model, optimizer, number: int) -> float:
    """One step on this rank's half of a global batch that depends only on the step number."""
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, LENGTH), generator=torch.Generator().manual_seed(number))
    half = ids[dist.get_rank() :: dist.get_world_size()]
    loss = model(input_ids=half, labels=half).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def main(workdir: Path, tokenizer_folder: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a mismatched collective fails, never hangs
    rank = dist.get_rank()
    checkpoint = workdir / f"checkpoint-{CHECKPOINT_AT}"

    model, optimizer = sharded_model(seed=0)
    straight = []
    for number in range(1, STEPS + 1):
        straight.append(step(model, optimizer, number))
        if number == CHECKPOINT_AT:
            model_state, optimizer_state = get_state_dict(model, optimizer)  # sharded: each rank its own shards
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint)

    save_full_model(model, workdir / "final", AutoTokenizer.from_pretrained(tokenizer_folder))
    gathered = {name: tensor.full_tensor().contiguous() for name, tensor in model.state_dict().items()}
    sharded = all(hasattr(parameter, "full_tensor") for parameter in model.parameters())

    resumed_model, resumed_optimizer = sharded_model(seed=1)
    model_state, optimizer_state = get_state_dict(resumed_model, resumed_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(resumed_model, resumed_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    resumed = [step(resumed_model, resumed_optimizer, number) for number in range(CHECKPOINT_AT + 1, STEPS + 1)]

    if rank == 0:
        gathered.pop("lm_head.weight", None)  # tied to the embeddings
        save_file(gathered, workdir / "reference.safetensors")
        (workdir / "result.json").write_text(json.dumps({
            "world_size": dist.get_world_size(), "parameters_sharded": sharded, "straight": straight,
            "resumed": resumed, "checkpoint_files": sorted(p.name for p in checkpoint.iterdir()),
        }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
