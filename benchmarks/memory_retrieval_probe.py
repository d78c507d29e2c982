"""Can the real checkpoint's own queries find a passkey's block among the blocks a window has evicted?

The design question of a block memory past the window (InfLLM-style: keys that leave the window kept in blocks of
b tokens, each scored by a few representative keys, the top k retrieved): which block size, which representatives
and which query find the block that holds the passkey, layer by layer, before anything is built. Measured on the
checkpoint as published (LlamaForCausalLM, full attention): one forward of the passkey prompt (lex.passkey) per key,
the q/k projections of every layer recorded before rotary (scored without positions). The evicted region is every
token from the 4th to the window's first (w back from the question); the blocks are cut there from the start.

For each block size, representatives and query, per layer: the rank of the best needle block among all blocks by
the score summed over heads (a query head against its key/value head). Printed: the share of (key, layer) pairs whose
needle block ranks within the top k, for k = 4, 8, 16.

Representatives of a block: `mean` (the mean key), `norm4` (the 4 keys of largest norm, the block's score their
best), `local4` (InfLLM's: the 4 keys the block's own queries attend to most, causal within the block), `all` (every
key: the best any selection of representatives can do).
Query: `last` (the last prompt token's), `chunk` (the mean of the question's tokens, as while a prompt is read).
Filler: the landmark-attention sentences repeated, or natural text (--filler_text, e.g. a play of
../shared/data/shakespeare), the harder form: every block then differs from the others.

    python benchmarks/memory_retrieval_probe.py [--lengths 4096,8192] [--depths 0.1,0.5] [--keys 3]
"""

import argparse
import random
import sys
from pathlib import Path

import torch

from common import real_checkpoint

from lex.models import load_model, load_tokenizer
from lex.passkey import FILLER, QUESTION

SINKS = 4


def prompt(tokenizer, length: int, depth: float, key: str, text: str | None) -> tuple[torch.Tensor, range]:
    """filler (repeated sentences, or `text`), the needle at `depth` of `length` tokens, filler, the question; and
    the needle's token range."""
    filler = tokenizer(text or FILLER, add_special_tokens=False).input_ids
    needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False
                       ).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    body = length - len(needle) - len(question)
    before = int(body * depth)
    tokens = (filler * (body // len(filler) + 2))
    ids = tokens[:before] + needle + tokens[before:body] + question
    return torch.tensor(ids)[None], range(before, before + len(needle))


def record(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's pre-rotary keys (kv_heads, T, d) and queries (heads, T, d)."""
    keys, queries, hooks = [], [], []
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in model.model.layers:
        attention = layer.self_attn
        hooks.append(attention.k_proj.register_forward_hook(
            lambda m, i, o: keys.append(o[0].view(-1, config.num_key_value_heads, head_dim).transpose(0, 1))))
        hooks.append(attention.q_proj.register_forward_hook(
            lambda m, i, o: queries.append(o[0].view(o.shape[1], -1, head_dim).transpose(0, 1))))
    with torch.no_grad():
        model(ids, logits_to_keep=1)
    for hook in hooks:
        hook.remove()
    return keys, queries


def block_scores(keys: torch.Tensor, queries: torch.Tensor, query: torch.Tensor, block: int, first: int, stop: int,
                 how: str) -> torch.Tensor:
    """Scores (blocks,) of the blocks of `block` keys in [first, stop): the query (heads, d) against each block's
    representatives, summed over heads (`queries`: every token's, for `local4`)."""
    groups = query.shape[0] // keys.shape[0]
    n = (stop - first) // block
    k = keys[:, first : first + n * block].reshape(keys.shape[0], n, block, -1)  # (kv, n, b, d)
    k = k.repeat_interleave(groups, dim=0)  # (heads, n, b, d)
    q = queries[:, first : first + n * block].reshape(queries.shape[0], n, block, -1)
    if how == "mean":
        return torch.einsum("hd,hnd->hn", query, k.mean(2)).sum(0)
    if how == "all":
        per_key = torch.einsum("hd,hnbd->hnb", query, k)
        return per_key.max(-1).values.sum(0)
    if how == "norm4":
        top = k.norm(dim=-1).topk(4, dim=-1).indices  # (heads, n, 4)
    else:  # local4: the keys the block's own queries attend to most (causal within the block)
        scores = torch.einsum("hnid,hnjd->hnij", q, k) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(~torch.ones(block, block, dtype=torch.bool).tril(), float("-inf"))
        top = scores.softmax(-1).sum(-2).topk(4, dim=-1).indices
    chosen = k.gather(2, top[..., None].expand(*top.shape, k.shape[-1]))
    return torch.einsum("hd,hnrd->hnr", query, chosen).max(-1).values.sum(0)


def report(ranks: dict[tuple, list[int]]) -> None:
    """One line per (length, block size, representatives, query): the shares of needle blocks in the top k."""
    for (length, block, how, form), values in sorted(ranks.items()):
        share = {k: sum(r < k for r in values) / len(values) for k in (4, 8, 16)}
        median = sorted(values)[len(values) // 2]
        print(f"{length:>7}{block:>7}{how:>8}{form:>7}{share[4]:>7.2f}{share[8]:>7.2f}{share[16]:>7.2f}{median:>13}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--depths", default="0.1,0.5")
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--blocks", default="64,128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--filler_text", type=Path, help="a text file as filler (default: repeated sentences)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(real_checkpoint(args.model))
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    question = len(tokenizer(QUESTION, add_special_tokens=False).input_ids)
    text = args.filler_text.read_text(encoding="utf-8")[: 8 * max(map(int, args.lengths.split(",")))] \
        if args.filler_text else None
    rng = random.Random(0)
    print(f"{'length':>7}{'block':>7}{'repr':>8}{'query':>7}{'top4':>7}{'top8':>7}{'top16':>7}{'median rank':>13}")
    ranks: dict[tuple, list[int]] = {}
    for length in map(int, args.lengths.split(",")):
        for depth in map(float, args.depths.split(",")):
            for _ in range(args.keys):
                ids, needle = prompt(tokenizer, length, depth, str(rng.randint(10000, 99999)), text)
                keys, queries = record(model, ids)
                stop = ids.shape[1] - args.window
                for block in map(int, args.blocks.split(",")):
                    hit = {(needle.start - SINKS) // block, (needle.stop - 1 - SINKS) // block}
                    for how in ("mean", "norm4", "local4", "all"):
                        for form in ("last", "chunk"):
                            for layer_keys, layer_queries in zip(keys, queries):
                                tail = layer_queries[:, -question:]
                                query = tail[:, -1] if form == "last" else tail.mean(1)
                                scores = block_scores(layer_keys, layer_queries, query, block, SINKS, stop, how)
                                order = scores.argsort(descending=True).tolist()
                                rank = min(order.index(b) for b in hit if b < len(order))
                                ranks.setdefault((length, block, how, form), []).append(rank)
                print(f"  {length} tokens, depth {depth}: recorded", file=sys.stderr, flush=True)
        report({key: value for key, value in ranks.items() if key[0] == length})
    return 0


if __name__ == "__main__":
    sys.exit(main())
