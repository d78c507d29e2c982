"""The `lex` command lines: each module parses one command's arguments and calls the library.

The contract every command keeps (lex/cli.py enforces the last point):

1. Its parser is `LexArgumentParser("NAME", description=...)`, or, for dataclass arguments, a class that mixes
   `Spellings` into transformers' HfArgumentParser (lex/commands/train.py). Flags are spelled as run_clm and
   TrainingArguments spell them, with underscores: `add_argument("--max_new_tokens")` (either spelling may be
   given) registers `--max_new_tokens` and the alias `--max-new-tokens`; `--help` shows the underscore one,
   and error messages name a flag as the user typed it (`parser.flag("max_new_tokens")`).
2. A bad command line (unknown flag, missing argument, a value that does not parse or is out of range) is
   `parser.error("...")`, which raises UsageError. A bad input found later (a file, a folder, a value the
   library refuses) is a LexError (convert/errors.py) from the library: DataError, ConversionError,
   ExportError. Messages name the flag, file or field and the allowed values.
3. Every input is checked before anything is written. Folders are written through convert.staging
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
import sys
from collections.abc import Callable, Iterable

from convert.errors import LexError

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
    (HfArgumentParser for `lex train`): both spellings of every long flag, one shown in --help, abbreviations
    that match one flag under two spellings are not ambiguous, and errors raise UsageError (one line)."""

    def add_argument(self, *names, **kwargs):
        hidden: set[str] = set()
        if names and names[0].startswith("-"):
            names, hidden = spellings(names)
        action = super().add_argument(*names, **kwargs)
        action.hidden_spellings = hidden
        return action

    def add_argument_group(self, *args, **kwargs):
        group = _Group(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _get_option_tuples(self, option_string):
        # "--max_new" may abbreviate one flag under two spellings: one match, not an ambiguity
        matches, seen = [], set()
        for match in super()._get_option_tuples(option_string):
            if id(match[0]) not in seen:
                seen.add(id(match[0]))
                matches.append(match)
        return matches

    def spelled(self, action: argparse.Action) -> str:
        """The option string the user typed for `action` (the last one on the command line), else its name."""
        for argument in reversed(getattr(self, "_argv", [])):
            typed = argument.split("=", 1)[0]
            if typed in action.option_strings:
                return typed
            if typed.startswith("--") and len(typed) > 2:
                prefixed = [s for s in action.option_strings if s.startswith(typed)]
                if prefixed and all(self._option_string_actions[s] is action for s in prefixed):
                    return typed if typed in prefixed else prefixed[0]
        shown = [s for s in action.option_strings if s not in action.hidden_spellings and s.startswith("--")]
        return (shown or action.option_strings or [action.dest])[0]

    def flag(self, dest: str) -> str:
        """The flag of argument `dest` as the user spelled it, for error messages."""
        actions = [a for a in self._actions if a.dest == dest and a.option_strings]
        return self.spelled(actions[0]) if actions else dest

    def error(self, message: str):
        for action in self._actions:
            if getattr(action, "hidden_spellings", None):
                message = message.replace("/".join(action.option_strings), self.spelled(action))
        raise UsageError(message)


class _Group(Spellings, argparse._ArgumentGroup):
    def add_argument_group(self, *args, **kwargs):  # argparse groups do not nest; keep its own behaviour
        return argparse._ArgumentGroup.add_argument_group(self, *args, **kwargs)


class OneSpellingHelp(argparse.RawDescriptionHelpFormatter):
    """--help lists each flag once, in its underscore spelling."""

    def _format_action_invocation(self, action):
        hidden = getattr(action, "hidden_spellings", None)
        if hidden:
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if s not in hidden]
        return super()._format_action_invocation(action)


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
