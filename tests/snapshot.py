"""The reading path's numbers, kept across a redesign: the logits and the block memory's chosen blocks of a fixed set
of tiny models, as main computed them before the reading path was rebuilt (tests/data/reading_snapshot.safetensors,
written by `python -m tests.snapshot`), which test_snapshot.py compares with what the code computes now.

The set: every position method in blockwise and sliding mode, with 0 and 4 sinks at cache positions, without and
with a block memory (where the method takes one); each reads a left-padded batch of two prompts longer than the
window through a LexCache, then decodes 6 tokens greedily across a block boundary of the window and, with a memory,
of the memory's blocks. Random weights (every parameter perturbed), so no term passes by accident.
"""

import itertools
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modeling_lex import LexCache
from tests.helpers import PAD, perturbed_model, prompt, tiny_config

SNAPSHOT = Path(__file__).parent / "data" / "reading_snapshot.safetensors"
METHODS = ("xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal", "none")
MEMORY_METHODS = ("xpos", "rope", "decay", "alibi", "none")  # those the float64 reference reads a memory with
LENGTHS = (40, 33)  # a left-padded batch: the shorter row padded by 7
NEW_TOKENS = 6  # 40 + 6 crosses 48, a block boundary of the window (w = 16, b = 8) and of the memory (blocks of 4)


def cases() -> list[tuple[str, dict]]:
    """(name, config overrides) of every model in the set."""
    found = []
    for method, mode, sinks in itertools.product(METHODS, ("blockwise", "sliding"), (0, 4)):
        base = dict(position_embedding_type=method, attention_mode=mode, attention_sinks=sinks,
                    attention_sink_positions="cache", num_attention_heads=4, num_key_value_heads=2)
        found.append((f"{method}-{mode}-{sinks}", base))
        if method in MEMORY_METHODS:
            found.append((f"{method}-{mode}-{sinks}-memory",
                          {**base, "attention_memory_blocks": 3, "attention_memory_block_size": 4}))
    return found


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The left-padded batch of two prompts (ids, attention mask)."""
    longest = max(LENGTHS)
    ids = torch.full((len(LENGTHS), longest), PAD)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        ids[row, longest - length :] = prompt(1, length, seed=length)[0]
        mask[row, longest - length :] = 1
    return ids, mask


def compute(overrides: dict) -> dict[str, torch.Tensor]:
    """The prompt's logits (batch, tokens, vocab), each decoding step's logits (batch, steps, vocab), the decoded
    tokens and, with a memory, each layer's chosen blocks after the last step."""
    model = perturbed_model(tiny_config(**overrides))
    ids, mask = batch()
    cache = LexCache(model.config)
    with torch.no_grad():
        read = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits
        steps, tokens = [], []
        for _ in range(NEW_TOKENS):
            token = read[:, -1:].argmax(-1) if not steps else steps[-1].argmax(-1, keepdim=True)
            tokens.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            steps.append(model(token, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1])
    out = {"prompt": read, "steps": torch.stack(steps, 1), "tokens": torch.cat(tokens, 1)}
    for index, layer in enumerate(cache.layers):
        if layer.memory is not None and layer.memory.chosen is not None:
            out[f"blocks.{index}"] = layer.memory.chosen.blocks
    return out


def load() -> dict[str, torch.Tensor]:
    return load_file(SNAPSHOT)


if __name__ == "__main__":
    saved = {}
    for name, overrides in cases():
        for field, tensor in compute(overrides).items():
            saved[f"{name}.{field}"] = tensor.contiguous()
    SNAPSHOT.parent.mkdir(exist_ok=True)
    save_file(saved, SNAPSHOT)
    print(f"{len(cases())} models, {len(saved)} tensors -> {SNAPSHOT}")
