"""Which positions should attention sinks have? Perplexity of a full-attention Llama read through a window, by rule.

A model pretrained with full attention, read through a sliding or blockwise window of w keys plus S sinks (the
first S tokens of the document), scored on long held-out documents by the paper's "segments" protocol at several
lengths. Rules for the sinks' position, as the literature has them:

- "true": a sink is seen at its true distance (what LexConfig.attention_sinks computes);
- "cache": StreamingLLM's positions within the cache: the sinks sit just before the query's window, the query
  at S + (its offset in the window), so a sink is never further than S + w away;
- "none": no sinks (the window alone).

The evaluation is a naive O(n^2) attention written here (an attention function registered with transformers and
selected on the HF Llama itself, queries in chunks), independent of modeling_lex; with rule "true" it is checked
against the LEX model converted from the same weights, so the two "true" columns are one measurement.

    python benchmarks/sink_positions.py LLAMA_FOLDER --files "../shared/data/shakespeare/*.txt" \\
        --lengths 128,512,2048 --window 128 --sinks 4 [--output sinks.json]
"""

import argparse
import glob
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from common import write_output

RULES = ("none", "true", "cache")


def window_start(mode: str, window: int, index: torch.Tensor) -> torch.Tensor:
    """The first key of a query's window (blockwise: its previous block's start, blocks of w/2)."""
    if mode == "sliding":
        return (index - window + 1).clamp(min=0)
    block = window // 2
    return ((index // block - 1) * block).clamp(min=0)


def make_attention(model, mode: str, window: int, sinks: int, rule: str, chunk: int = 512):
    """An attention function for the HF Llama: the mode's window, plus S sinks placed by `rule`."""
    rotary = model.model.rotary_emb

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(x, positions)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        n = query.shape[2]
        positions = torch.arange(n, device=query.device)
        if rule == "cache":  # undo the rotation HF applied at each token's position, to place sinks anew
            query_raw = rotate(query, -positions[None])
            sink_keys = rotate(key[:, :, :sinks], -positions[None, :sinks])
        outputs = []
        for first in range(0, n, chunk):
            q_index = positions[first : first + chunk, None]
            k_index = positions[None, : q_index[-1, 0] + 1]
            scores = query[:, :, first : first + chunk] @ key[:, :, : k_index.shape[1]].transpose(-1, -2) * scaling
            in_window = (k_index <= q_index) & (k_index >= window_start(mode, window, q_index))
            as_sink = (k_index < sinks) & (k_index <= q_index) & ~in_window if rule != "none" else None
            allowed = in_window if as_sink is None else in_window | as_sink
            if rule == "cache" and sinks:
                offset = q_index[:, 0] - window_start(mode, window, q_index[:, 0])  # the query's place in its window
                for j in range(min(sinks, k_index.shape[1])):
                    placed = rotate(query_raw[:, :, first : first + chunk], (sinks + offset - j)[None])
                    cached = (placed * sink_keys[:, :, j : j + 1]).sum(-1) * scaling
                    scores[..., j] = torch.where(as_sink[:, j], cached, scores[..., j])
            scores = scores.masked_fill(~allowed, float("-inf"))
            outputs.append(scores.softmax(-1, dtype=torch.float32).to(value.dtype) @ value[:, :, : k_index.shape[1]])
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None

    return attention


@torch.no_grad()
def segment_ppl(model, documents: list[torch.Tensor], length: int) -> float:
    """The paper's protocol: each document's first max-length tokens in non-overlapping segments, read cold."""
    nll, count = 0.0, 0
    for document in documents:
        for start in range(0, len(document) - length + 1, length):
            ids = document[start : start + length][None]
            logits = model(ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += length - 1
    return math.exp(nll / count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="an HF Llama folder (with its tokenizer)")
    parser.add_argument("--files", required=True, help="glob of evaluation text files")
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--modes", default="sliding,blockwise")
    parser.add_argument("--documents", type=int, default=8, help="at most this many documents")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    texts = [Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(args.files))]
    documents = [torch.tensor(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    documents = [d[: max(lengths)] for d in documents if len(d) >= max(lengths)][: args.documents]
    rows = [{"mode": "full", "rule": "-", **{str(n): segment_ppl(model, documents, n) for n in lengths}}]
    for mode in args.modes.split(","):
        for rule in RULES:
            name = f"sinks-{mode}-{rule}"
            ALL_ATTENTION_FUNCTIONS.register(name, make_attention(model, mode, args.window, args.sinks, rule))
            model.set_attn_implementation(name)
            rows.append({"mode": mode, "rule": rule, **{str(n): segment_ppl(model, documents, n) for n in lengths}})
        model.set_attn_implementation("sdpa")
    header = "| mode | sinks at | " + " | ".join(map(str, lengths)) + " |"
    print(f"{len(documents)} documents, window {args.window}, {args.sinks} sinks\n{header}")
    print("|" + "---|" * (len(lengths) + 2))
    for row in rows:
        print(f"| {row['mode']} | {row['rule']} | " + " | ".join(f"{row[str(n)]:.2f}" for n in lengths) + " |")
    write_output(args, {"window": args.window, "sinks": args.sinks, "documents": len(documents),
                               "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
