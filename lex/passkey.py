"""Passkey retrieval: a number hidden at a chosen distance from the end of filler text, asked for at the end.

Reports, per distance, how often greedy decoding reproduces the key and the mean NLL of the key's tokens,
so a reader sees what a window of w can and cannot recall: beyond the window (blockwise: w/2 .. w back)
the key is simply not visible, and a LEX model cannot retrieve it.
"""

import random

import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = " What is the pass key? The pass key is "


def passkey_prompt(tokenizer, distance: int, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of filler + "The pass key is KEY." about `distance` tokens before the question, and the key's ids."""
    needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False).input_ids
    filler = tokenizer(FILLER, add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    after = (filler * (distance // len(filler) + 1))[: max(distance - len(needle) - len(question), 0)]
    before = filler * 2
    ids = torch.tensor(before + needle + after + question)
    return ids, torch.tensor(tokenizer(key, add_special_tokens=False).input_ids)


@torch.no_grad()
def probe(model, tokenizer, distances: list[int], trials: int = 5, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for distance in distances:
        hits, nll, count = 0, 0.0, 0
        for _ in range(trials):
            key = str(rng.randint(10000, 99999))
            prompt, answer = passkey_prompt(tokenizer, distance, key)
            full = torch.cat([prompt, answer])[None].to(model.device)
            logits = model(full, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, answer.to(logits.device), reduction="sum").item()
            count += len(answer)
            hits += int(torch.equal(logits.argmax(-1).cpu(), answer))
        rows.append({"distance": distance, "accuracy": hits / trials, "key_nll_per_token": nll / count})
    return rows


def passkey_rows(model, tokenizer, name: str, trials: int = 5, **labels) -> list[dict]:
    """`probe` at w/4, w/2, w, 2w and 4w tokens (w: the model's attention window; a model without one, its
    training length), rows labelled with `name` and `labels` (attention mode, sinks)."""
    w = getattr(model.config, "attention_window", None) or model.config.max_position_embeddings
    distances = sorted({w // 4, w // 2, w, 2 * w, 4 * w})
    return [{"model": name, **labels, "window": w, **row} for row in probe(model, tokenizer, distances, trials)]
