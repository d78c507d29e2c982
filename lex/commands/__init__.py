"""The `lex` command lines: each module parses one command's arguments and calls the library.

The contract every command keeps (lex/cli.py enforces the last point):

1. Its parser is `LexArgumentParser("NAME", description=...)`, or, for dataclass arguments, a class that mixes
   `Spellings` into transformers' HfArgumentParser (lex/commands/train.py). Flags are spelled as run_clm and
   TrainingArguments spell them, with underscores: `add_argument("--max_new_tokens")` (either spelling may be
   given) registers `--max_new_tokens` and the alias `--max-new-tokens`; `--help` shows the underscore one,
   and error messages name a flag as the user typed it (`parser.flag("max_new_tokens")`).
2. A bad command line (unknown flag, missing argument, a value that does not parse or is out of range) is
   `parser.error("...")`, which raises UsageError. A bad input found later (a file, a folder, a value the
   library refuses) is a LexError (lex_base/errors.py) from the library: DataError, ModelError, ConversionError,
   ExportError. Messages name the flag, file or field and the allowed values.
3. Every input is checked before anything is written. Folders are written through lex_base.staging
   (`atomic_directory`, `atomic_files`): nothing appears until the block completes, so a command that fails
   (or is killed, or gets SIGTERM) leaves its output folder as it was.
4. lex/cli.py runs the command: a LexError (UsageError included) or an OSError becomes one line
   `lex NAME: message` on stderr and exit status 2, no traceback; SIGTERM cleans up as Ctrl-C does and exits
   with status 143. Any other exception is a bug of ours and keeps its traceback.

A new command, e.g. `lex convert-hf SRC OUT [--attention_mode MODE] [--force]`, in lex/commands/convert_hf.py:

    def main(argv: list[str] | None = None) -> int:
        parser = LexArgumentParser("convert-hf", description=__doc__)
        parser.add_argument("src", type=Path)
        parser.add_argument("out", type=Path)
        parser.add_argument("--attention_mode", choices=ATTENTION_MODES)   # --attention-mode works too
        parser.add_argument("--force", action="store_true")
        args = parser.parse_args(argv)                  # a bad command line: UsageError, exit 2
        convert_hf(args.src, args.out, args.attention_mode, args.force)  # raises ConversionError, exit 2
        return 0

plus one line in lex/cli.py's COMMANDS: "convert-hf": ("lex.commands.convert_hf", "main", "...").
"""

import argparse
import copy
import os
import re
import sys
from collections.abc import Callable, Iterable

from lex_base.errors import LexError

ALIAS_NOTE = "Flags are spelled with underscores, as in run_clm.py; the hyphenated spelling (--flag-name) works too."


class UsageError(LexError):
    """A command line that does not parse: an unknown flag, a missing argument, a value out of range."""


def spellings(names: Iterable[str]) -> tuple[list[str], set[str]]:
    """(option strings, hidden aliases) for the names given to add_argument: every long option in its
    underscore spelling first, then the hyphen spellings that differ from it (the aliases)."""
    short, canonical, aliases = [], [], []
    for name in names:
        if not name.startswith("--"):
            short.append(name)
            continue
        underscore, hyphen = "--" + name[2:].replace("-", "_"), "--" + name[2:].replace("_", "-")
        if underscore not in canonical:
            canonical.append(underscore)
        if hyphen != underscore and hyphen not in aliases:
            aliases.append(hyphen)
    return [*short, *canonical, *aliases], set(aliases)


class Spellings:
    """The flag-spelling and error half of LexArgumentParser, mixed into any argparse.ArgumentParser subclass
    (HfArgumentParser for `lex train`): both spellings of every long flag (one shown in --help, by
    OneSpellingHelp), an abbreviation that matches one flag under its two spellings is that flag, and errors
    raise UsageError (one line) naming a flag as the user typed it. argparse's public interface only."""

    @property
    def flag_actions(self) -> dict[str, argparse.Action]:
        """Every option string of this parser and its groups -> its action."""
        return vars(self).setdefault("lex_flag_actions", {})

    def add_argument(self, *names, **kwargs):
        return self.add_spelled(super().add_argument, names, kwargs)

    def add_spelled(self, add: Callable[..., argparse.Action], names: tuple[str, ...], kwargs: dict):
        """`add(*names, **kwargs)` (the parser's or a group's add_argument) with both spellings of each long flag;
        the hyphen ones are the action's `hidden_spellings`."""
        hidden: set[str] = set()
        if names and names[0].startswith("-"):
            names, hidden = spellings(names)
        action = add(*names, **kwargs)
        action.hidden_spellings = hidden
        self.flag_actions.update(dict.fromkeys(action.option_strings, action))
        return action

    def add_argument_group(self, *args, **kwargs):
        return SpelledGroup(self, super().add_argument_group(*args, **kwargs))

    def parse_known_args(self, args=None, namespace=None):
        self.typed_argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self.unabbreviated(self.typed_argv), namespace)

    def prefixed(self, typed: str) -> dict[str, argparse.Action]:
        """The option strings that `typed` abbreviates (or is) -> their actions."""
        return {s: action for s, action in self.flag_actions.items() if s.startswith(typed)}

    def unabbreviated(self, argv: list[str]) -> list[str]:
        """`argv` with each abbreviation of one flag under both its spellings written out (`--max` for
        --max_new_tokens / --max-new-tokens), which argparse would call ambiguous; the rest as given."""
        if not self.allow_abbrev:
            return argv
        written = []
        for i, argument in enumerate(argv):
            if argument == "--":
                return written + argv[i:]
            typed, equals, value = argument.partition("=")
            matches = self.prefixed(typed) if typed.startswith("--") and typed not in self.flag_actions else {}
            if len(matches) > 1 and len({id(action) for action in matches.values()}) == 1:
                argument = next(iter(matches)) + equals + value
            written.append(argument)
        return written

    def spelled(self, action: argparse.Action) -> str:
        """The option string the user typed for `action` (the last one on the command line), else its name."""
        for argument in reversed(getattr(self, "typed_argv", [])):
            typed = argument.split("=", 1)[0]
            if typed in action.option_strings:
                return typed
            if typed.startswith("--") and len(typed) > 2:
                matches = self.prefixed(typed)
                if matches and all(match is action for match in matches.values()):
                    return next(iter(matches))
        shown = [s for s in action.option_strings if s not in action.hidden_spellings and s.startswith("--")]
        return (shown or action.option_strings or [action.dest])[0]

    def flag(self, dest: str) -> str:
        """The flag of argument `dest` as the user spelled it, for error messages."""
        actions = [a for a in self.flag_actions.values() if a.dest == dest]
        return self.spelled(actions[0]) if actions else dest

    def error(self, message: str):
        for action in dict.fromkeys(self.flag_actions.values()):
            if getattr(action, "hidden_spellings", None):
                message = message.replace("/".join(action.option_strings), self.spelled(action))
        ambiguous = re.fullmatch(r"(ambiguous option: \S+ could match )(.*)", message)
        if ambiguous:  # each flag once, under the first spelling argparse lists
            shown = {}
            for option in ambiguous[2].split(", "):
                shown.setdefault(id(self.flag_actions.get(option, option)), option)
            message = ambiguous[1] + ", ".join(shown.values())
        raise UsageError(message)


class SpelledGroup:
    """An argument group of a Spellings parser (argparse's own, registered with the parser) whose add_argument
    gives both spellings; everything else is the group's."""

    def __init__(self, parser: Spellings, group):
        self.parser, self.group = parser, group

    def add_argument(self, *names, **kwargs):
        return self.parser.add_spelled(self.group.add_argument, names, kwargs)

    def __getattr__(self, name: str):
        return getattr(self.group, name)


class OneSpellingHelp(argparse.RawDescriptionHelpFormatter):
    """--help lists each flag once, in its underscore spelling (the usage line names a flag by its first option
    string, the underscore one, already)."""

    def add_argument(self, action: argparse.Action) -> None:
        hidden = getattr(action, "hidden_spellings", None)
        if hidden:
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if s not in hidden]
        super().add_argument(action)


class LexArgumentParser(Spellings, argparse.ArgumentParser):
    """The parser of `lex COMMAND` (see the module docstring)."""

    def __init__(self, command: str, **kwargs):
        kwargs.setdefault("formatter_class", OneSpellingHelp)
        kwargs.setdefault("epilog", ALIAS_NOTE)
        super().__init__(prog=f"lex {command}", **kwargs)


# ---------------------------------------------------------------- argument types (errors name the value)


def comma_list(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list whose every item is one of `allowed`."""
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(text.split(","))
        for item in items:
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
        return items

    return parse


def require_device(parser: argparse.ArgumentParser, device: str) -> None:
    """A bad command line unless `device` can be used here (a CUDA device asked for where none is)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"{parser.flag('device')} {device}: no CUDA device is available")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, e.g. 256,512,1024."""
    values = []
    for item in text.split(","):
        try:
            values.append(positive_int(item.strip()))
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{error} (comma-separated integers >= 1, e.g. 256,512)") from None
    return values


def non_negative_ints(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers >= 0, e.g. 0,4."""
    values = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer (comma-separated integers >= 0, "
                                             "e.g. 0,4)") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{value} must be >= 0 (comma-separated integers >= 0, e.g. 0,4)")
        values.append(value)
    return tuple(dict.fromkeys(values))


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


QUANTIZE_HELP = ("weight-only quantization for CPU decoding through torchao (pip install -e \".[cpu-quant]\"): "
                 "int8 (one scale per row) or int4 (groups of 32), every Linear and the LM head; the model then "
                 "computes in float32 unless --dtype says otherwise (the quantized Linears multiply in bfloat16)")


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    """--quantize, as every command that loads or writes a model spells it (lex.quantization's kinds)."""
    from lex.quantization import QUANTIZATIONS

    parser.add_argument("--quantize", choices=QUANTIZATIONS, help=QUANTIZE_HELP)


def check_quantize(parser: argparse.ArgumentParser, quantize: str | None, device: str) -> None:
    """A bad command line where --quantize is asked for off the CPU (its layouts are the CPU kernels')."""
    if quantize and device != "cpu":
        parser.error(f"{parser.flag('quantize')} {quantize} lays the weights out for the CPU's kernels; "
                     f"{parser.flag('device')} {device} (allowed: cpu)")


# ---------------------------------------------------------------- several processes: --tp_plan

TP_HELP = ("shard the model over the processes torchrun starts (tensor parallel, as transformers' "
           "from_pretrained(..., tp_plan='auto') does): each holds its share of every layer's heads and of its cache; "
           "run as `torchrun --nproc_per_node N -m lex.cli COMMAND ... --tp_plan auto` (gloo on CPU, nccl on CUDA); "
           "only rank 0 prints and writes")


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    """--tp_plan, as transformers' from_pretrained spells it."""
    parser.add_argument("--tp_plan", choices=("auto",), help=TP_HELP)


def check_tp(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bad command line for --tp_plan: outside torchrun (no WORLD_SIZE), or with --quantize (the CPU kernels'
    layouts hold whole tensors)."""
    if args.tp_plan is None:
        return
    if "WORLD_SIZE" not in os.environ:
        parser.error(f"{parser.flag('tp_plan')} {args.tp_plan} shards the model over the processes torchrun starts: "
                     "run `torchrun --nproc_per_node N -m lex.cli ...` (WORLD_SIZE is not set)")
    if getattr(args, "quantize", None):
        parser.error(f"{parser.flag('tp_plan')} with {parser.flag('quantize')} {args.quantize}: quantized weights "
                     "are laid out whole for the CPU's kernels (allowed: one of the two)")


def only_rank_zero_speaks() -> bool:
    """Under torchrun every process runs the command: the others' stdout and stderr go to os.devnull, so what the
    command prints (and a refusal, which every rank meets alike) appears once. Returns whether this is rank 0."""
    if int(os.environ.get("RANK", "0")) == 0:
        return True
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)
    return False


# ---------------------------------------------------------------- how a model reads: the --attention_* flags

READING_HELP = {
    "attention_mode": "blockwise, sliding or full (default: the model's own; a converted checkpoint's: what it "
                      "computes, full or sliding for a sliding window)",
    "attention_window": "w, the window of blockwise and sliding modes (even, >= 4; default: the model's own; a "
                        "converted checkpoint's: its sliding window, else max_position_embeddings)",
    "attention_sinks": "S: the first S tokens of a document stay visible to every later token in blockwise and "
                       "sliding modes (default: the model's own; a converted checkpoint's: 0)",
    "attention_sink_positions": "where a query sees its sinks from: cache (within the cache, StreamingLLM's rule; a "
                                "converted checkpoint's default) or true (at their true positions)",
    "attention_memory_blocks": "k: a block memory past the window in blockwise and sliding modes, the k best blocks "
                               "of the evicted keys read by every query chunk and decoded token (0: none; default: "
                               "the model's own; a converted checkpoint's: 0)",
    "attention_memory_block_size": "tokens per memory block (default: the model's own; a converted checkpoint's: "
                                   "LexConfig's, 16)",
}


def add_reading_arguments(parser: argparse.ArgumentParser, *, sweep: bool = False, **defaults) -> None:
    """The --attention_* flags that say how a model reads, one help text each for every command. `sweep` (lex
    eval-length): --attention_modes and comma-separated values, one reading per combination; `defaults`: a
    command's own default of a flag where it has one (convert-hf writes a folder, so nothing is "the model's")."""
    from configuration_lex import ATTENTION_MODES, SINK_POSITIONS

    def add(name: str, help_prefix: str = "", **kwargs) -> None:
        if name in defaults:
            kwargs["default"] = defaults[name]
        text = READING_HELP["attention_mode" if name == "attention_modes" else name]
        parser.add_argument(f"--{name}", help=help_prefix + text, **kwargs)

    if sweep:
        add("attention_modes", "comma-separated modes, each one reading: ", default="full,blockwise",
            type=comma_list(ATTENTION_MODES))
        add("attention_window", type=positive_int)
        add("attention_sinks", "comma-separated, e.g. 0,4: ", default=(0,), type=non_negative_ints)
        add("attention_sink_positions", "comma-separated: ", type=comma_list(SINK_POSITIONS))
        add("attention_memory_blocks", "comma-separated, e.g. 0,64 (rows labelled attention_memory_blocks; full "
            "attention rows with 0 only): ", type=non_negative_ints)
    else:
        add("attention_mode", choices=ATTENTION_MODES)
        add("attention_window", type=positive_int)
        add("attention_sinks", type=int)
        add("attention_sink_positions", choices=SINK_POSITIONS)
        add("attention_memory_blocks", type=int)
    add("attention_memory_block_size", type=positive_int)


def check_reading_arguments(parser: Spellings, args: argparse.Namespace) -> None:
    """The checks of add_reading_arguments' flags that a type cannot make: one-value counts >= 0; in a sweep, a
    block size only with a memory to size (every reading of it labelled by both) and no memory over full attention
    alone (it sees every key already). One reading leaves the rest to the config, which names the field."""
    if not hasattr(args, "attention_modes"):
        for dest in ("attention_sinks", "attention_memory_blocks"):
            value = getattr(args, dest)
            if value is not None and value < 0:
                parser.error(f"{parser.flag(dest)} must be >= 0{' (0: no memory)' if 'memory' in dest else ''}, "
                             f"got {value}")
        return
    blocks = args.attention_memory_blocks or ()
    if args.attention_memory_block_size is not None and not any(blocks):
        parser.error(f"{parser.flag('attention_memory_block_size')} {args.attention_memory_block_size} sizes the "
                     f"block memory: give {parser.flag('attention_memory_blocks')} with a value > 0 too")
    if any(blocks) and set(args.attention_modes) == {"full"}:
        parser.error(f"{parser.flag('attention_memory_blocks')} {','.join(map(str, blocks))} with "
                     f"{parser.flag('attention_modes')} full: full attention sees every key, a memory of evicted ones "
                     "has nothing to add (allowed: blockwise or sliding modes, or attention_memory_blocks 0)")
