"""One contract for every command: a bad input is exit status 2 and one line `lex COMMAND: ...` naming the flag
or file, no traceback, and no output folder created or changed; a bug keeps its traceback; both spellings of
every flag parse the same; the command lines of README and docs/ parse as written."""

import argparse
import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configuration_lex import LexConfig
from lex.data import kjv_books, train_tokenizer
from modeling_lex import LexForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TINY = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A tiny LEX model folder with its tokenizer, a good text, and the bad inputs users have."""
    base = tmp_path_factory.mktemp("inputs")
    tokenizer = train_tokenizer([b["text"][:20_000] for b in kjv_books()[:2]], vocab_size=300)
    torch.manual_seed(0)
    config = LexConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=16)
    LexForCausalLM(config).save_pretrained(base / "model")
    tokenizer.save_pretrained(base / "model")
    (base / "good.txt").write_text(kjv_books()[0]["text"][:5000])
    (base / "empty.txt").write_text("  \n")
    (base / "binary.bin").write_bytes(bytes(range(256)) * 4)  # NUL bytes: a binary file
    (base / "latin1.txt").write_bytes("In the beginning God created the café".encode("latin-1"))
    (base / "notmodel").mkdir()
    (base / "notmodel" / "notes.txt").write_text("not a model")
    (base / "results.json").write_text("")
    return {"model": str(base / "model"), "good": str(base / "good.txt"), "empty": str(base / "empty.txt"),
            "binary": str(base / "binary.bin"), "latin1": str(base / "latin1.txt"),
            "notmodel": str(base / "notmodel"), "missing": str(base / "missing"), "dir": str(base),
            "emptyjson": str(base / "results.json")}


TRAIN = ["train", "--output_dir", "{out}", "--block_size", "16", "--max_steps", "1", "--use_cpu", "--report_to",
         "none", "--vocab_size", "300"]
EVAL = ["eval-length", "{model}", "--output_dir", "{out}", "--lengths", "8,16"]
GENERATE = ["generate", "{model}", "--max_new_tokens", "2"]
EXPORT = ["export", "{model}", "{out}"]
DEMO = ["demo", "--quick", "--output_dir", "{out}"]
# (command line, what the one line must say); {names} are the `inputs` above, {out} the output folder
CASES = {
    # lex train
    "train-missing-file": ([*TRAIN, "--train_files", "{missing}/a.txt"], "--train_files: no file matches"),
    "train-glob-nothing": ([*TRAIN, "--train_files", "{dir}/*.nothing"], "--train_files: no file matches"),
    "train-empty-file": ([*TRAIN, "--train_files", "{empty}"], "the training files hold no text: {empty}"),
    "train-binary": ([*TRAIN, "--train_files", "{binary}"], "--train_files {binary}: a binary file"),
    "train-not-utf8": ([*TRAIN, "--train_files", "{latin1}"], "--train_files {latin1}: not UTF-8 text"),
    "train-binary-validation": ([*TRAIN, "--train_files", "{good}", "--validation_files", "{binary}"],
                                "--validation_files {binary}: a binary file"),
    "train-odd-block-size": ([*TRAIN, "--block_size", "255"], "--block_size 255 must be even"),
    "train-unknown-flag": ([*TRAIN, "--learningrate", "1e-3"], "unrecognized arguments: --learningrate 1e-3"),
    "train-bad-value": ([*TRAIN, "--max_steps", "ten"], "argument --max_steps: invalid int value: 'ten'"),
    "train-not-a-model": ([*TRAIN, "--model_name_or_path", "{notmodel}"],
                          "--model_name_or_path {notmodel}: not a model folder"),
    "train-no-such-model": ([*TRAIN, "--model_name_or_path", "{missing}"],
                            "--model_name_or_path {missing}: no such model folder"),
    "train-overrides-with-model": ([*TRAIN, "--model_name_or_path", "{model}", "--config_overrides", TINY],
                                   "--config_overrides builds a new model and cannot be combined with "
                                   "--model_name_or_path"),
    "train-bad-packing": ([*TRAIN, "--packing", "docs"],
                          "argument --packing: invalid choice: 'docs' (choose from 'concatenate', 'documents')"),
    "train-bad-override": ([*TRAIN, "--config_overrides", "attention_mode=dilated", "--train_files", "{good}",
                            "--tokenizer_name", "{model}"],
                           ("--config_overrides: ", "'attention_mode' expected one of ('blockwise', 'sliding', "
                            "'full'), got dilated")),
    "train-trainingarguments-refusal": ([*TRAIN, "--load_best_model_at_end", "--eval_strategy", "steps",
                                         "--save_strategy", "no"], "--load_best_model_at_end requires"),
    # lex eval-length
    "eval-glob-nothing": ([*EVAL, "--files", "/nonexistent/*.txt"], "--files: no file matches '/nonexistent/*.txt'"),
    "eval-empty-file": ([*EVAL, "--files", "{empty}"], "--files {empty}: the file holds no text"),
    "eval-binary": ([*EVAL, "--files", "{binary}"], "--files {binary}: a binary file"),
    "eval-not-utf8": ([*EVAL, "--files", "{latin1}"], "--files {latin1}: not UTF-8 text (byte 0xe9 at offset 36"),
    "eval-lengths-12a": ([*EVAL, "--files", "{good}", "--lengths", "12a"], "argument --lengths: '12a' is not an integer"),
    "eval-sinks-negative": ([*EVAL, "--files", "{good}", "--attention_sinks", "0,-4"],
                            "argument --attention_sinks: -4 must be >= 0"),
    "eval-lengths-zero": ([*EVAL, "--files", "{good}", "--lengths", "8,0"], "argument --lengths: 0 must be >= 1"),
    "eval-length-too-long": ([*EVAL, "--files", "{good}", "--lengths", "100000"],
                             "no evaluation document holds 100000 tokens"),
    "eval-bad-mode": ([*EVAL, "--attention_modes", "full,dilated"],
                      "argument --attention_modes: 'dilated' is not one of blockwise, sliding, full"),
    "eval-unknown-flag": ([*EVAL, "--lenghts", "8"], "unrecognized arguments: --lenghts 8"),
    "eval-not-a-model": (["eval-length", "{notmodel}", "--output_dir", "{out}"],
                         "MODEL {notmodel}: not a model folder (it has no config.json)"),
    "eval-no-such-model": (["eval-length", "{missing}", "--output_dir", "{out}"], "MODEL {missing}: no such model"),
    # lex generate (writes no folder)
    "generate-missing-prompt": ([*GENERATE, "--prompt_file", "{missing}"], "--prompt_file {missing} does not exist"),
    "generate-empty-prompt": ([*GENERATE, "--prompt_file", "{empty}"], "--prompt_file {empty}: the file holds no text"),
    "generate-binary-prompt": ([*GENERATE, "--prompt_file", "{binary}"], "--prompt_file {binary}: a binary file"),
    "generate-not-utf8-prompt": ([*GENERATE, "--prompt_file", "{latin1}"], "--prompt_file {latin1}: not UTF-8"),
    "generate-not-a-model": (["generate", "{notmodel}", "--prompt_file", "{good}"], "MODEL {notmodel}: not a model"),
    "generate-zero-tokens": ([*GENERATE, "--prompt_file", "{good}", "--max_new_tokens", "0"],
                             "--max_new_tokens must be >= 1, got 0"),
    "generate-negative-sinks": ([*GENERATE, "--prompt_file", "{good}", "--attention_sinks", "-1"],
                                "--attention_sinks must be >= 0, got -1"),
    "generate-odd-window": ([*GENERATE, "--prompt_file", "{good}", "--attention_window", "7"],
                            "attention_window=7 must be an even integer >= 4"),
    "generate-top-p": ([*GENERATE, "--prompt_file", "{good}", "--top_p", "2"], "--top_p must be in (0, 1], got 2.0"),
    "generate-compile-memory": ([*GENERATE, "--prompt_file", "{good}", "--compile", "--attention_mode", "sliding",
                                 "--attention_memory_blocks", "2"],
                                "--compile with a block memory (attention_memory_blocks=2)"),
    "generate-unknown-flag": ([*GENERATE, "--prompt_file", "{good}", "--beams", "2"], "unrecognized arguments: --beams"),
    # lex serve (each refused before anything loads or listens)
    "serve-not-a-model": (["serve", "{notmodel}"], "MODEL {notmodel}: not a model"),
    "serve-tp-plan": (["serve", "{model}", "--tp_plan", "auto"], "--tp_plan auto: lex serve decodes in one process"),
    "serve-state-dir-alone": (["serve", "{model}", "--state_dir", "{dir}"],
                              "--state_dir keeps states pushed out of RAM: give --state_cache_bytes > 0 too"),
    "serve-bad-port": (["serve", "{model}", "--port", "70000"], "--port must be in 1..65535, got 70000"),
    "serve-default-past-limit": (["serve", "{model}", "--max_new_tokens_limit", "8", "--default_max_tokens", "9"],
                                 "--default_max_tokens 9 is past --max_new_tokens_limit 8"),
    # lex export
    "export-not-a-model": (["export", "{notmodel}", "{out}"], "MODEL_DIR {notmodel}: not a model folder"),
    "export-no-such-model": (["export", "{missing}", "{out}"], "MODEL_DIR {missing}: no such model folder"),
    "export-empty-results": ([*EXPORT, "--results", "{emptyjson}"], "--results {emptyjson}: cannot read it as JSON"),
    "export-binary-results": ([*EXPORT, "--results", "{binary}"], "--results {binary}: cannot read it as JSON"),
    "export-shard-size": ([*EXPORT, "--max_shard_size", "big"], "--max_shard_size 'big': use bytes or a size"),
    "export-license": ([*EXPORT, "--license", "MIT License"], "--license 'MIT License': use a Hub license id"),
    "export-dry-run-alone": ([*EXPORT, "--dry-run"], "--dry-run go with --push_to_hub REPO_ID"),
    "export-unknown-flag": ([*EXPORT, "--shard_size", "1GB"], "unrecognized arguments: --shard_size 1GB"),
    # lex convert-torchscale / convert-to-torchscale
    "convert-missing-checkpoint": (["convert-torchscale", "{missing}.pt", "{out}"], "{missing}.pt: no such checkpoint"),
    "convert-empty-checkpoint": (["convert-torchscale", "{empty}", "{out}"], "CHECKPOINT {empty}: not a checkpoint"),
    "convert-binary-checkpoint": (["convert-torchscale", "{binary}", "{out}"], "refusing to load {binary}"),
    "convert-bad-mode": (["convert-torchscale", "{binary}", "{out}", "--attention_mode", "dilated"],
                         "argument --attention_mode: invalid choice: 'dilated'"),
    "convert-bad-dtype": (["convert-torchscale", "{binary}", "{out}", "--dtype", "int8"],
                          "argument --dtype: invalid choice: 'int8'"),
    "convert-unknown-flag": (["convert-torchscale", "{binary}", "{out}", "--cfg", "c.json"],
                             "unrecognized arguments: --cfg c.json"),
    "to-torchscale-not-a-model": (["convert-to-torchscale", "{notmodel}", "{out}/back.pt"],
                                  "{notmodel}: cannot load a model from it"),
    "to-torchscale-no-such-folder": (["convert-to-torchscale", "{missing}", "{out}/back.pt"],
                                     "{missing}: not a model folder"),
    "to-torchscale-bad-format": (["convert-to-torchscale", "{model}", "{out}/back.pt", "--format", "onnx"],
                                 "argument --format: invalid choice: 'onnx' (choose from 'auto', 'decoder', 'fairseq')"),
    # lex convert-hf / convert-to-hf
    "convert-hf-no-such-folder": (["convert-hf", "{missing}", "{out}"], "{missing}: not a model folder"),
    "convert-hf-not-llama": (["convert-hf", "{model}", "{out}"], "model_type 'lex' is not a convertible model"),
    "convert-hf-odd-window": (["convert-hf", "{model}", "{out}", "--attention_window", "x"],
                              "argument --attention_window: 'x' is not an integer"),
    "convert-hf-bad-mode": (["convert-hf", "{model}", "{out}", "--attention_mode", "dilated"],
                            "argument --attention_mode: invalid choice: 'dilated'"),
    "convert-hf-negative-sinks": (["convert-hf", "{model}", "{out}", "--attention_sinks", "-1"],
                                  "--attention_sinks must be >= 0, got -1"),
    "to-hf-xpos": (["convert-to-hf", "{model}", "{out}"], "LexConfig.position_embedding_type='xpos': no HF"),
    "to-hf-no-such-folder": (["convert-to-hf", "{missing}", "{out}"], "{missing}"),
    # lex demo
    "demo-no-such-corpus": ([*DEMO, "--corpus", "{missing}"], "--corpus {missing}: not a folder"),
    "demo-not-utf8-corpus": ([*DEMO, "--corpus", "{dir}"], "--corpus {latin1}: not UTF-8 text"),
    "demo-minutes-zero": ([*DEMO, "--minutes", "0"], "argument --minutes: 0 must be a positive number"),
    "demo-odd-length": ([*DEMO, "--training_length", "6"], "--training_length 6: must be a multiple of 4"),
    "demo-bad-variant": ([*DEMO, "--variants", "xpos,t5"], "argument --variants: 't5' is not one of"),
    "demo-unknown-flag": ([*DEMO, "--steps", "5"], "unrecognized arguments: --steps 5"),
}
# what lets a command write into (or replace) an existing output folder: the refusal must still come first
EXISTING_OK = {"train": ["--overwrite_output_dir"], "export": ["--force"], "convert-torchscale": ["--force"],
               "convert-to-torchscale": ["--force"], "convert-hf": ["--force"], "convert-to-hf": ["--force"], "eval-length": [], "demo": [], "generate": [], "serve": []}


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder` (hidden ones included) with a digest of its bytes and its mode."""
    return {p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            + oct(p.stat().st_mode) for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("existing", [False, True], ids=["new-output", "existing-output"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, existing, inputs, lex_run, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    command, expected = CASES[case]
    args = [a.format(out=out, **inputs) for a in command]
    if existing:
        out.mkdir()
        (out / "earlier.txt").write_text("keep me")
        if args[0] == "demo":
            (out / "study.json").write_text("{}")  # a previous study: the demo may replace it
        args += EXISTING_OK[args[0]]
    before = snapshot(tmp_path)

    status, _, err = lex_run(*args)

    lines = [line for line in err.splitlines() if line.startswith("lex")]
    assert status == 2, err
    assert "Traceback" not in err and "usage:" not in err  # no traceback, no argparse usage block
    assert len(lines) == 1 and lines[0].startswith(f"lex {args[0]}: "), err
    assert err.rstrip().splitlines()[-1] == lines[0]  # the last thing said
    for fragment in (expected,) if isinstance(expected, str) else expected:
        assert fragment.format(**inputs) in lines[0]
    assert snapshot(tmp_path) == before  # no output folder, no staging folder, nothing changed


def test_every_command_has_a_bad_input_case():
    from lex.cli import COMMANDS

    tried = {CASES[case][0][0] for case in CASES}
    assert tried == set(COMMANDS)


def test_a_bug_keeps_its_traceback(monkeypatch, lex_run, inputs):
    """Only user errors are one line: any other exception escapes main() (the console script prints it)."""
    import lex.commands.export

    def broken(*args, **kwargs):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(lex.commands.export, "export", broken)
    with pytest.raises(KeyError, match="a bug of ours"):
        lex_run("export", inputs["model"], "out")


def test_one_line_for_multi_line_messages_and_os_errors(monkeypatch, lex_run, inputs, tmp_path):
    import lex.commands.export
    from lex.export import ExportError

    def refuses(*args, **kwargs):
        raise ExportError("first line\n   second line")

    monkeypatch.setattr(lex.commands.export, "export", refuses)
    assert lex_run("export", inputs["model"], tmp_path / "out")[::2] == (2, "lex export: first line second line\n")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "out"))

    monkeypatch.setattr(lex.commands.export, "export", disk_full)
    assert lex_run("export", inputs["model"], tmp_path / "out")[::2] == (
        2, f"lex export: {tmp_path / 'out'}: No space left on device\n")


def test_unknown_command_is_one_line(lex_run):
    status, _, err = lex_run("trian")
    assert status == 2 and err.count("\n") == 1 and "unknown command 'trian'" in err


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["eval-length", "MODEL", "--files", "/nonexistent/*.txt", "--output_dir", "OUT"],
     "lex eval-length: --files: no file matches '/nonexistent/*.txt'"),
    (["eval-length", "MODEL", "--lengths", "12a", "--output_dir", "OUT"],
     "lex eval-length: argument --lengths: '12a' is not an integer"),
    (["train", "--block_size", "255", "--output_dir", "OUT"], "lex train: --block_size 255 must be even"),
])
def test_console_script_prints_one_line_and_exits_2(args, expected, inputs, tmp_path):
    """The measured cases of the issue, through `python -m lex.cli` as a shell runs it: stderr is that one line."""
    args = [inputs["model"] if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "lex.cli", *args], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [run.stderr.splitlines()[0]] and run.stderr.startswith(expected), run.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- flag spellings


def parsers() -> dict[str, argparse.ArgumentParser]:
    from lex.commands import convert, convert_hf, demo, eval_length, export, generate, serve
    from lex.commands.train import TrainArgumentParser

    return {"demo": demo.build_parser(), "eval-length": eval_length.build_parser(),
            "generate": generate.build_parser(), "serve": serve.build_parser(), "export": export.build_parser(),
            "convert-torchscale": convert.from_torchscale_parser(),
            "convert-to-torchscale": convert.to_torchscale_parser(), "convert-hf": convert_hf.convert_hf_parser(),
            "convert-to-hf": convert_hf.convert_to_hf_parser(), "train": TrainArgumentParser()}


def required_arguments(parser) -> list[str]:
    args = []
    for action in parser._actions:
        if not action.option_strings:
            args += ["x"] * (1 if action.nargs in (None, "+") else 0)
        elif action.required:
            args += [action.option_strings[0], "x"]
    return args


def value_for(parser, action, base: list[str], spelling: str) -> list[str] | None:
    """A value this flag accepts (none for switches): the first candidate that parses; None if none does
    (TrainingArguments' dict-typed fields cannot be given on a command line at all)."""
    if action.nargs == 0:
        return []
    candidates = [*(map(str, action.choices or [])), "3", "0.5", "8,16", "xpos", "full", "x", "true", "{}"]
    for value in candidates:
        try:
            parser.parse_args([*base, spelling, value])
            return [value]
        except Exception:  # noqa: BLE001 (UsageError, or a type function's own error)
            continue
    return None


def test_both_spellings_of_every_flag_parse_the_same_and_help_shows_one():
    renamed = {"generate": ["--prompt-file", "--max-new-tokens", "--do-sample", "--top-k", "--top-p",
                            "--attention-mode", "--no-progress"],
               "export": ["--push-to-hub", "--dry-run", "--max-shard-size"],
               "convert-torchscale": ["--attention-mode"]}
    checked, unparsable = {name: [] for name in renamed}, []
    for name, parser in parsers().items():
        base = required_arguments(parser)
        aliased = [a for a in parser._actions if getattr(a, "hidden_spellings", None)]
        assert aliased or name in ("convert-to-torchscale", "convert-to-hf"), name
        formatter = parser._get_formatter()
        formatter.add_arguments(parser._actions)
        listed = parser.format_usage() + formatter.format_help()  # the usage line and the flags of --help
        for action in aliased:
            for alias in sorted(action.hidden_spellings):
                canonical = "--" + alias[2:].replace("-", "_")
                assert canonical in action.option_strings
                value = value_for(parser, action, base, canonical)
                if value is None:
                    unparsable.append(canonical)
                    continue
                assert vars(parser.parse_args([*base, canonical, *value])) == vars(
                    parser.parse_args([*base, alias, *value]))
                assert not re.search(rf"{re.escape(alias)}(?![\w-])", listed), (name, alias)  # shown once
                assert re.search(rf"{re.escape(canonical)}(?![\w-])", listed) or action.help == argparse.SUPPRESS
                checked.setdefault(name, []).append(alias)
    for name, aliases in renamed.items():
        assert set(aliases) <= set(checked[name]), name
    assert unparsable == ["--liger_kernel_config", "--parallelism_config"]  # dict or object types: not CLI values


def test_errors_name_the_flag_as_typed_and_abbreviations_are_not_ambiguous():
    from lex.commands import UsageError
    from lex.commands.generate import build_parser

    parser = build_parser()
    for spelling in ("--max_new_tokens", "--max-new-tokens"):
        with pytest.raises(UsageError, match=f"argument {spelling}: invalid int value: 'many'"):
            parser.parse_args(["m", "--prompt_file", "p", spelling, "many"])
    assert parser.parse_args(["m", "--prompt_file", "p", "--max_new", "5"]).max_new_tokens == 5  # one flag, 2 names
    with pytest.raises(UsageError, match="ambiguous option: --top could match --top_k, --top_p"):
        parser.parse_args(["m", "--prompt_file", "p", "--top", "5"])


def readme_command_lines() -> list[list[str]]:
    """Every `lex ...` or `accelerate launch ... -m lex.cli ...` line of the code blocks of README.md and the
    documentation (docs/), continuation lines joined and comments dropped, as argument lists after `lex`."""
    text = "\n".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(command, comments=True)
            for i, word in enumerate(words):
                if word == "lex" or word.endswith("/bin/lex") or (word == "lex.cli" and words[i - 1] == "-m"):
                    rest = words[i + 1 :]
                    ends = [j for j, w in enumerate(rest) if w in ("&&", "||", ";", "|")]
                    lines.append(rest[: ends[0]] if ends else rest)
                    break
    return lines


def test_readme_command_lines_parse_as_written(tmp_path, monkeypatch):
    """The flags, values and their combinations README and docs/ show are accepted (placeholders such as ... dropped)."""
    from lex.commands.train import TrainArgumentParser
    from lex.training import check_arguments

    monkeypatch.chdir(tmp_path)
    lines = readme_command_lines()
    assert {line[0] for line in lines} == {"demo", "train", "eval-length", "generate", "convert-torchscale",
                                          "convert-to-torchscale", "convert-hf", "convert-to-hf", "export", "serve"}
    tables = parsers()
    for name, *args in lines:
        args = [a for a in args if a != "..."]
        if name == "train":
            model = args[args.index("--model_name_or_path") + 1] if "--model_name_or_path" in args else None
            if model and not Path(model).exists():  # the folder an earlier command of the page writes (quickstart)
                LexConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=8192, attention_mode="sliding",
                          attention_window=1024, attention_sinks=4, attention_sink_positions="cache",
                          attention_memory_blocks=64).save_pretrained(model)
            model_args, data_args, output_args, peft_args, training_args = TrainArgumentParser().parse(args)
            check_arguments(model_args, data_args, training_args, output_args, peft_args)
        else:
            tables[name].parse_args(args)


def test_choice_sets_are_literal_types_and_the_flags_offer_them():
    """PACKINGS, PROTOCOLS, DTYPES and --format's values each come from one Literal type, and the command lines
    offer exactly those values."""
    import typing

    from lex import data, models, perplexity, training
    from lex.commands import convert

    assert data.PACKINGS == typing.get_args(data.Packing) == ("concatenate", "documents")
    assert typing.get_type_hints(training.DataArguments)["packing"] is data.Packing
    assert perplexity.PROTOCOLS == typing.get_args(perplexity.Protocol) == ("segments", "strided")
    assert models.DTYPES == typing.get_args(models.Dtype)
    assert convert.FORMATS == typing.get_args(convert.TorchScaleFormat) == ("auto", "decoder", "fairseq")
    tables = parsers()

    def choices(parser, dest):
        (action,) = [a for a in parser._actions if a.dest == dest]
        return tuple(action.choices) if action.choices else action.type

    assert choices(tables["train"], "packing") == data.PACKINGS
    assert choices(tables["convert-to-torchscale"], "format") == convert.FORMATS
    assert choices(tables["generate"], "dtype") == choices(tables["convert-torchscale"], "dtype") == models.DTYPES
    assert choices(tables["eval-length"], "protocols")(",".join(perplexity.PROTOCOLS)) == perplexity.PROTOCOLS
    with pytest.raises(argparse.ArgumentTypeError):
        choices(tables["eval-length"], "protocols")("segments,sliding")
