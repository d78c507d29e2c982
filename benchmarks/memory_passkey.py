"""Passkey recall past the window on the real checkpoint: full attention as published, the window + sinks, and the
window + sinks with the block memory (`attention_memory_blocks`), keys at several depths of several lengths.

The prompt (greedy, plain text): landmark attention's passkey prompt (an instruction, filler, a 5-digit key hidden
at a depth of the document: "The pass key is KEY. Remember it. KEY is the pass key.", more filler, "What is the pass
key? The pass key is"). In SmolLM2-135M-Instruct's chat template the checkpoint as published missed half the keys
in full attention at 2k-4k tokens (3 of 6); in plain text it recalled 6 of 6. Filler is
the landmark-attention sentences repeated (`repeated`) or natural text (`natural`: --filler_text, by default the
42 works of ../shared/data/shakespeare, each key's filler from its own random place), the harder form. A key is
recalled when the reply holds it. A key and its place in the natural filler are drawn once per form, depth and key
number and read at every length, so full attention as published, which reads only --full_length (default 4,096,
inside the training length), reads the same keys as the windowed models. The reading `near` is full attention as
published at --full_length on each long prompt cut to what a windowed reading of it needs: the instruction, the
filler just before the key, the key, the prompt's last filler (what the window holds when the question is read)
and the question; whether the checkpoint answers from that text at all. Each row prints as it is measured
(reading, form, length, depth, recalled of --keys, the seconds the cell took) and --output is rewritten after each
(a run stopped by a time limit keeps its rows); at the end, each windowed cell against full attention's on the same
keys and depth.

    python benchmarks/memory_passkey.py [--lengths 8192,32768,131072] [--depths 0.1,0.5,0.9] [--keys 3]
        [--forms repeated,natural] [--cells natural:0.5,natural:0.9] [--readings full,window,memory,near]
        [--memory_blocks 64] [--memory_block_size 16] [--quantize int4] [--device cuda]
        [--output memory_passkey.json]
"""

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import torch

from common import ROOT, peak_rss_mb, real_checkpoint, write_output

from convert.hf import lex_from_hf
from lex.models import load_model, load_tokenizer, quantized
from lex.quantization import QUANTIZATIONS
from lex.passkey import FILLER, QUESTION
from modeling_lex import LexCache

SHAKESPEARE = ROOT.parent / "shared" / "data" / "shakespeare"
DRAWN_FOR = 131072  # the natural filler's places are drawn for this length at least: a run of fewer or shorter
# lengths reads the same keys in the same places as the default grid


def natural_text(folder: Path) -> str:
    return "\n\n".join(path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.txt")))


INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
               "quiz you about the important information there.")


def prompt_parts(tokenizer, length: int, depth: float, key: str, filler: list[int]) -> tuple[list[int], ...]:
    """Landmark attention's passkey prompt of about `length` tokens, with the key at `depth` of its filler, in
    parts: the instruction, the filler before the needle, the needle, the filler after it, the question."""
    needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False
                       ).input_ids
    head = tokenizer(INSTRUCTION, add_special_tokens=False).input_ids
    tail = tokenizer(QUESTION, add_special_tokens=False).input_ids
    body = length - len(head) - len(tail) - len(needle)
    text = filler[:body] if len(filler) >= body else filler * (body // len(filler))  # repeated: whole sentences
    before = int(len(text) * depth)
    return head, text[:before], needle, text[before:], tail


def prompt_ids(tokenizer, length: int, depth: float, key: str, filler: list[int]) -> torch.Tensor:
    """The whole prompt of `prompt_parts`."""
    return torch.tensor(sum(prompt_parts(tokenizer, length, depth, key, filler), []))[None]


def near_prompt_ids(tokenizer, length: int, depth: float, key: str, filler: list[int], near: int) -> torch.Tensor:
    """The prompt of `length` cut to `near` tokens with what a windowed reading of it needs: the instruction, the
    filler just before the needle (`depth` of what the cut keeps), the needle, the prompt's last filler tokens (what
    its window holds when the question is read) and the question. Full attention as published reads this inside its
    training length: whether the checkpoint answers from the key's own surroundings and the document's own end."""
    head, before, needle, after, tail = prompt_parts(tokenizer, length, depth, key, filler)
    room = near - len(head) - len(needle) - len(tail)
    kept = before[len(before) - min(len(before), int(room * depth)) :]
    return torch.tensor(head + kept + needle + after[max(0, len(after) - (room - len(kept))) :] + tail)[None]


@torch.no_grad()
def reply(model, ids: torch.Tensor, tokenizer, memory_directory: str | None) -> str:
    cache = LexCache(model.config, memory_directory) if model.config.model_type == "lex" else None
    ids = ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, cache=cache,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--lengths", default="8192,32768,131072", help="what the windowed readings read")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--forms", default="repeated,natural")
    parser.add_argument("--cells", default=None, help="read only these form:depth cells (natural:0.5,natural:0.9); "
                        "the keys are drawn for every cell of --forms and --depths, so a subset reads the same keys")
    parser.add_argument("--filler_text", type=Path, default=SHAKESPEARE, help="a text file or a folder of them")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--memory_block_size", type=int, default=16)
    parser.add_argument("--full_length", type=int, default=4096, help="the one length full attention reads")
    parser.add_argument("--readings", default="full,window,memory",
                        help="of full, window, memory and near (full attention at --full_length on each prompt's "
                        "key surroundings and end, at every length)")
    parser.add_argument("--memory_directory", default=None, help="keep the block memory memory-mapped there")
    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="add the readings window+KIND and memory+KIND: the same on KIND weights")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(real_checkpoint(args.model))
    published, tokenizer = load_model(path, device=args.device).eval(), load_tokenizer(path)
    window = lex_from_hf(published, "sliding", args.window, args.sinks, "cache").eval()
    memory = lex_from_hf(published, "sliding", args.window, args.sinks, "cache").eval()
    memory.config.attention_memory_blocks = args.memory_blocks
    memory.config.attention_memory_block_size = args.memory_block_size
    models = {"full": published, "window": window, "memory": memory, "near": published}
    if args.quantize:  # the windowed readings again on quantized copies of the weights (lex.quantization)
        models |= {f"{name}+{args.quantize}": quantized(copy.deepcopy(models[name]), args.quantize)
                   for name in ("window", "memory")}
    unknown = sorted(set(args.readings.split(",")) - models.keys())
    if unknown:
        parser.error(f"--readings {','.join(unknown)}: allowed values are {','.join(models)}")
    source = args.filler_text
    text = natural_text(source) if source.is_dir() else source.read_text(encoding="utf-8")
    natural = tokenizer(text, add_special_tokens=False).input_ids
    lengths = list(map(int, args.lengths.split(",")))
    rng = random.Random(0)
    cells = {}  # (form, depth): [(key, start of its natural filler)], the same at every length
    for form in args.forms.split(","):
        for depth in map(float, args.depths.split(",")):
            cells[form, depth] = [(str(rng.randint(10000, 99999)),
                                   rng.randrange(len(natural) - max(lengths + [args.full_length, DRAWN_FOR])))
                                  for _ in range(args.keys)]
    if args.cells:
        wanted = {(form, float(depth)) for form, depth in (cell.split(":") for cell in args.cells.split(","))}
        if not wanted <= cells.keys():
            raise SystemExit(f"--cells {args.cells}: each must be form:depth among --forms {args.forms} and "
                             f"--depths {args.depths}")
        cells = {cell: keys for cell, keys in cells.items() if cell in wanted}
    repeated = tokenizer(FILLER, add_special_tokens=False).input_ids
    readings = [(name, length) for name in args.readings.split(",")
                for length in ([args.full_length] if name == "full" else lengths)]
    rows = []
    print(f"{'reading':>8}{'form':>10}{'length':>8}{'depth':>7}{'recalled':>10}{'seconds':>9}", flush=True)
    for name, length in sorted(readings, key=lambda reading: reading[1]):
        for (form, depth), keys in cells.items():
            fillers = [(key, natural[start : start + length] if form == "natural" else repeated)
                       for key, start in keys]
            prompts = [(key, near_prompt_ids(tokenizer, length, depth, key, filler, args.full_length) if name == "near"
                        else prompt_ids(tokenizer, length, depth, key, filler)) for key, filler in fillers]
            began = time.perf_counter()
            answers = [reply(models[name], ids, tokenizer, args.memory_directory) for _, ids in prompts]
            hits = sum(key in answer for (key, _), answer in zip(prompts, answers))
            seconds = time.perf_counter() - began
            rows.append({"reading": name, "form": form, "length": length, "depth": depth, "recalled": hits,
                         "keys": args.keys, "seconds": seconds, "answers": answers,
                         "keys_hidden": [key for key, _ in prompts]})
            print(f"{name:>8}{form:>10}{length:>8}{depth:>7}{hits:>7} /{args.keys}{seconds:>9.1f}", flush=True)
            write_output(args, {"rows": rows, "peak_rss_mb": peak_rss_mb()})
    full = {(row["form"], row["depth"]): row["recalled"] for row in rows if row["reading"] == "full"}
    near = {(row["form"], row["length"], row["depth"]): row["recalled"] for row in rows if row["reading"] == "near"}
    if full or near:
        print(f"\nagainst full attention at {args.full_length} on the same keys (recalled / full's"
              f"{' / near' if near else ''})")
        for row in rows:
            if row["reading"] not in ("full", "near"):
                reference = full.get((row["form"], row["depth"]))
                local = near.get((row["form"], row["length"], row["depth"]))
                row["full_recalled"], row["near_recalled"] = reference, local
                print(f"{row['reading']:>8}{row['form']:>10}{row['length']:>8}{row['depth']:>7}{row['recalled']:>5}"
                      f" / {reference if reference is not None else '-'}"
                      f"{'' if local is None else f' / {local}'}"
                      f"{'  below' if reference is not None and row['recalled'] < reference else ''}")
    print(f"peak RSS {peak_rss_mb():.0f} MB", flush=True)
    write_output(args, {"rows": rows, "peak_rss_mb": peak_rss_mb()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
