"""The project's one error type for what a user gave wrong: a file, a folder, a checkpoint, a flag's value.

`lex COMMAND` turns a LexError into one line `lex COMMAND: message` on stderr and exit status 2 (lex/cli.py);
any other exception that escapes a command is a bug of ours and keeps its traceback. Every raise site names
the flag, file or field at fault, with the allowed values where there is a choice.

Subclasses: ConversionError (convert.checkpoint), DataError (lex.data), ExportError (lex.export), UsageError
(lex.commands: the command line itself), OutputExistsError (below). LexError is a ValueError, as all of them
were before, so code that catches ValueError still catches them.

It lives in lex_base/, the room below convert/ and lex/ that both import (tests/test_layout.py);
configuration_lex/ is exported as flat remote code (lex.export) and must import nothing of the project.
"""


class LexError(ValueError):
    """A user error: raised before anything is written, its message names what is wrong and what is allowed."""


class OutputExistsError(LexError, FileExistsError):
    """An output that exists and may be replaced only with --force (still a FileExistsError for old callers)."""
