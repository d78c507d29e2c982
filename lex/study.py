"""`lex demo`: the LEX paper's length-extrapolation study, small enough for a laptop CPU.

Trains one small model per position method (xpos, rope, alibi by default) at a short training length l, with
the same tokenizer, seed, data order and number of steps, one after another with all cores; then evaluates
each at l/4 .. 16*l with full attention and with blockwise attention (BCA), and prints

- Table 2: perplexity by evaluation length (the paper's protocol, and a strided one beside it),
- Table 5: with and without BCA,
- Table 3: attention resolution (eq. 3) from each model's real pre-softmax scores,

with plots, CSV and JSON in --output_dir. `--minutes` sets the budget (default about 10 on 2 cores),
`--quick` is a smoke test of under 3 minutes, `--corpus DIR` studies other text (one document per file).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator, set_seed
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging

import modeling_lex  # noqa: F401
from configuration_lex import LexConfig
from modeling_lex import LexForCausalLM

from .data import DataError, load_documents, pack, tokenize_documents, train_tokenizer
from .eval_length import PROTOCOLS, evaluate_model, table, write_results
from .resolution import resolution_report
from .train import plot_loss

SETTINGS = {
    # name: hidden, layers, heads, vocab, training length, batch, learning rate
    "default": dict(hidden=128, layers=4, heads=4, vocab=2048, length=128, batch=16, lr=2e-3),
    "quick": dict(hidden=64, layers=2, heads=2, vocab=512, length=64, batch=16, lr=3e-3),
}


class StepTimer(TrainerCallback):
    """Measures seconds per optimizer step (after the first, which pays for warm-up)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return sorted(gaps)[len(gaps) // 2]


def make_model(variant: str, settings: dict, tokenizer) -> LexForCausalLM:
    # The absolute sinusoidal baseline is fairseq's Transformer: embeddings N(0, d^-1/2) scaled by sqrt(d), so
    # tokens and positions start at the same magnitude (with 0.02 and no scale the positions drown the tokens).
    absolute = variant == "sinusoidal"
    config = LexConfig(
        embedding_scale=settings["hidden"] ** 0.5 if absolute else 1.0,
        initializer_range=settings["hidden"] ** -0.5 if absolute else 0.02,
        vocab_size=len(tokenizer), hidden_size=settings["hidden"], intermediate_size=4 * settings["hidden"],
        num_hidden_layers=settings["layers"], num_attention_heads=settings["heads"],
        max_position_embeddings=settings["length"], position_embedding_type=variant,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LexForCausalLM(config)


def trainer_for(model, blocks, output_dir: Path, settings: dict, steps: int, seed: int, device: str, callbacks=()):
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=settings["batch"],
        learning_rate=settings["lr"], lr_scheduler_type="cosine", warmup_steps=0.05, weight_decay=0.01,
        logging_steps=max(1, steps // 20), save_strategy="no", eval_strategy="no", report_to="none", seed=seed,
        data_seed=seed, use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=blocks, data_collator=default_data_collator,
                      callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # the study prints its own summary
    return trainer


def calibrate(variant: str, settings: dict, tokenizer, blocks, output_dir: Path, seed: int, device: str) -> float:
    """Seconds per training step of this model size on this machine (a few throw-away steps)."""
    timer = StepTimer()
    model = make_model(variant, settings, tokenizer)
    trainer_for(model, blocks, output_dir / "calibration", settings, 6, seed, device, [timer]).train()
    return timer.seconds_per_step()


def read_corpus(corpus: Path | None, seed: int):
    if corpus is None:
        return load_documents(validation_fraction=0.1, seed=seed)
    documents = load_documents(train_files=str(corpus), validation_fraction=0.1, seed=seed)
    if "validation" not in documents:
        raise DataError(f"{corpus}: the study holds out whole documents and needs at least 2, got 1")
    return documents


def run(args: argparse.Namespace) -> dict:
    settings = dict(SETTINGS["quick" if args.quick else "default"])
    if args.training_length:
        settings["length"] = args.training_length
    minutes = args.minutes if args.minutes is not None else (2.0 if args.quick else 10.0)
    output_dir = args.output_dir
    length = settings["length"]
    lengths = [length // 4, length // 2, length, 2 * length, 4 * length, 8 * length, 16 * length]
    set_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    documents = read_corpus(args.corpus, args.seed)
    tokenizer = train_tokenizer((t for t in documents["train"]["text"]), settings["vocab"])
    blocks = pack(tokenize_documents(documents["train"], tokenizer), length)
    eval_texts = list(documents["validation"]["text"])
    eval_ids = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in eval_texts]
    eval_texts = [t for t, n in zip(eval_texts, eval_ids) if n >= lengths[-1]]
    if not eval_texts:
        raise DataError(f"no held-out document holds {lengths[-1]} tokens (16 x the training length)")
    if len(blocks) < settings["batch"]:
        raise DataError(f"the corpus packs into only {len(blocks)} blocks of {length} tokens")

    seconds_per_step = calibrate(args.variants[0], settings, tokenizer, blocks, output_dir, args.seed, args.device)
    train_share = 0.75 * minutes * 60 / len(args.variants)
    steps = max(10, int(train_share / seconds_per_step))
    print(f"corpus: {len(documents['train'])} training / {len(documents['validation'])} held-out documents; "
          f"{len(blocks)} blocks of l={length}; evaluating on {len(eval_texts)} documents of >= {lengths[-1]} tokens")
    print(f"training {len(args.variants)} models x {steps} steps (batch {settings['batch']}, "
          f"{seconds_per_step:.3f} s/step measured)", flush=True)

    rows, folders = [], []
    for variant in args.variants:
        folder = output_dir / variant
        set_seed(args.seed)
        model = make_model(variant, settings, tokenizer)
        started = time.perf_counter()
        trainer = trainer_for(model, blocks, folder, settings, steps, args.seed, args.device)
        trainer.train()
        trainer.save_model()
        tokenizer.save_pretrained(folder)
        trainer.save_state()
        plot_loss(trainer.state.log_history, folder / "loss_curve.png")
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"  {variant}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
              f"{time.perf_counter() - started:.0f} s, final train loss {losses[-1]:.3f}", flush=True)
        rows += evaluate_model(str(folder), eval_texts, lengths, ["full", "blockwise"], args.device,
                               progress=False, label=variant)
        folders.append(str(folder))

    write_results(rows, output_dir)
    resolution = resolution_report(folders, eval_texts, output_dir, args.device)
    report = {"settings": settings, "steps": steps, "lengths": lengths, "rows": rows}
    (output_dir / "study.json").write_text(json.dumps(report, indent=2))
    print_tables(rows, resolution, length)
    print(f"\nwrote {output_dir}: results.csv, results.json, ppl_vs_length.png, resolution.png, study.json")
    return report


def print_tables(rows: list[dict], resolution: str, length: int) -> None:
    by_paper = [r for r in rows if r["protocol"] == "segments"]
    paper_rows = [r for r in by_paper if r["attention_mode"] == "full"]
    paper_rows += [dict(r, model=f"{r['model']} + BCA") for r in by_paper
                   if r["attention_mode"] == "blockwise" and r["model"] == "xpos"]
    print(f"\nTable 2: perplexity by evaluation length (trained at l={length}; the paper's protocol: "
          "non-overlapping segments)\n" + table(paper_rows))
    print("\nTable 5: with (blockwise) and without (full) blockwise causal attention\n" + table(rows, "segments"))
    print("\nThe same with the strided protocol (every token scored with as much context as the length allows)\n"
          + table(rows, "strided"))
    print("\nTable 3: attention resolution (eq. 3)\n" + resolution)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="lex demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, help="time budget (default 10; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster smoke test")
    parser.add_argument("--corpus", type=Path, help="a folder of text files, one document per file")
    parser.add_argument("--variants", default="xpos,rope,alibi",
                        help="position types to compare: xpos,rope,alibi,decay,kerple,sandwich,sinusoidal")
    parser.add_argument("--training_length", type=int, help="l (default 128; 64 with --quick)")
    parser.add_argument("--output_dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    allowed = ("xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal")
    for variant in args.variants:
        if variant not in allowed:
            parser.error(f"--variants: {variant!r} is not one of {', '.join(allowed)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    try:
        run(args)
    except DataError as error:
        print(f"lex demo: {error}", file=sys.stderr)
        return 2
    return 0
