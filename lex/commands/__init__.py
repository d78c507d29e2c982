"""The `lex` command lines: each module parses one command's arguments and calls the library."""

import argparse


def comma_list(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated list whose every item is one of `allowed`."""
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(text.split(","))
        for item in items:
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
        return items

    return parse
