"""mkdocs hook: `<!-- lex-help COMMAND -->` in a page becomes that command's `lex COMMAND --help`, made at build
time from the parsers in lex/commands/, so the reference cannot drift from the command line."""

import contextlib
import io
import os
import re

HELP = re.compile(r"^<!-- lex-help ([a-z-]+) -->$", re.M)


def help_text(command: str) -> str:
    from lex.cli import COMMANDS, main

    if command not in COMMANDS:
        raise ValueError(f"docs ask for the help of `lex {command}`, which is not a command")
    os.environ.setdefault("COLUMNS", "110")  # argparse wraps at the terminal's width: one width for every build
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue().rstrip()


def on_page_markdown(markdown: str, page, config, files) -> str:
    return HELP.sub(lambda m: f"```text\n{help_text(m.group(1))}\n```", markdown)
