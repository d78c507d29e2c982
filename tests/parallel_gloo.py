"""Tensor and pipeline parallel on CPU, run by tests/test_parallel.py under
`torchrun --nproc_per_node N tests/parallel_gloo.py WORKDIR tp|pp [READING ...]`.

WORKDIR holds one LEX folder per reading (full, sliding + 4 sinks, sliding or blockwise + 4 sinks + a block
memory, and a Gemma 3 with local layers, sliding + 4 sinks + a memory) and prompt.pt. tp: each rank loads every folder as transformers users load a model across devices
(`from_pretrained(folder, tp_plan="auto")`, gloo) and records what it holds and computes: the world size, its
q_proj rows (of the full tensor's), its cache's key/value bytes after the prompt, the prompt's logits, 16 greedy
tokens, and each layer's chosen blocks of the memory after reading the prompt and decoding. pp: each rank loads the
folders with `DistributedConfig(pp_size=N)` (one stage of the layers a rank) and records the world size, the layers
its stage holds, the prompt's logits and 16 greedy tokens (a refusal ends the run, as it ends a user's). Rank r
writes {mode}{r}.json and {mode}{r}.pt to WORKDIR; the test compares the ranks with each other and with one
process.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers.distributed import DistributedConfig  # noqa: E402

from modeling_lex import LexCache, LexForCausalLM  # noqa: E402

READINGS = ("full", "sliding_sinks", "sliding_sinks_memory", "blockwise_sinks_memory", "gemma3_sliding_sinks_memory")
NEW_TOKENS = 16


def cache_bytes(cache: LexCache) -> int:
    """Bytes of the keys and values the cache's layers hold (the block memory's store apart)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


@torch.no_grad()
def reading(model: LexForCausalLM, ids: torch.Tensor) -> dict:
    """What one model computes: the prompt's logits through a LexCache, the cache's bytes and chosen blocks after
    the prompt and NEW_TOKENS greedy steps, and generate()'s greedy tokens."""
    cache = LexCache(model.config)
    logits = model(ids, cache=cache, use_cache=True).logits
    held = cache_bytes(cache)
    token = logits[:, -1:].argmax(-1)
    for _ in range(NEW_TOKENS):
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    blocks = {str(index): layer.memory.chosen.blocks.tolist() for index, layer in enumerate(cache.layers)
              if layer.memory is not None and layer.memory.chosen is not None}
    tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[:, ids.shape[1]:]
    return {"logits": logits, "tokens": tokens, "cache_bytes": held, "blocks": blocks}


@torch.no_grad()
def staged(model: LexForCausalLM, ids: torch.Tensor) -> dict:
    """What a pipeline stage returns: the prompt's logits (every stage gets the last one's) and greedy tokens."""
    tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[:, ids.shape[1]:]
    return {"logits": model(ids).logits, "tokens": tokens}


def main(workdir: Path, mode: str, readings: tuple[str, ...] = READINGS) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a mismatched collective fails, never hangs
    rank = dist.get_rank()
    ids = torch.load(workdir / "prompt.pt", weights_only=True)
    summary, tensors = {"world_size": dist.get_world_size()}, {}
    for name in readings:
        if mode == "tp":
            model = LexForCausalLM.from_pretrained(workdir / name, tp_plan="auto").eval()
            weight = model.model.layers[0].self_attn.q_proj.weight
            result = reading(model, ids)
            summary[name] = {"q_proj_rows": weight.to_local().shape[0], "q_proj_rows_in_all": weight.shape[0],
                             "cache_bytes": result["cache_bytes"], "blocks": result["blocks"],
                             "tokens": result["tokens"].tolist()}
        else:
            config = DistributedConfig(pp_size=dist.get_world_size())
            model = LexForCausalLM.from_pretrained(workdir / name, distributed_config=config).eval()
            result = staged(model, ids)
            held = [index for index, layer in enumerate(model.model.layers) if list(layer.parameters())]
            summary[name] = {"layers": held, "tokens": result["tokens"].tolist()}
        tensors[name] = result["logits"].contiguous()
    torch.save(tensors, workdir / f"{mode}{rank}.pt")
    (workdir / f"{mode}{rank}.json").write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], tuple(sys.argv[3:]) or READINGS)
