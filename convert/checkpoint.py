"""What the converters share: their error (ConversionError), the refusal of a LexConfig field no target computes,
the check of a checkpoint's tensors against a model's; reading checkpoints without running their pickles, and
fairseq's omegaconf references."""

import pickle
import re
from argparse import Namespace
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import torch

from lex_base.errors import LexError


def safe_globals() -> list:
    """What a fairseq checkpoint holds besides tensors and containers, all of it plain data.

    Older saves keep their hyper-parameters in an argparse Namespace; `extra_state` (iterator and meter states)
    may hold numpy numbers and numeric arrays. Object arrays stay refused: their dtype is not on the list.
    """
    allowed: list = [Namespace]
    try:
        import numpy as np
    except ImportError:
        return allowed
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    codes = np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"
    allowed += [np.ndarray, np.dtype, *{type(np.dtype(code)) for code in codes}]
    for name in ("_reconstruct", "scalar"):  # numpy 1 and 2 pickle these under different module names
        function = getattr(multiarray, name)
        allowed += [(function, f"numpy.core.multiarray.{name}"), (function, f"numpy._core.multiarray.{name}")]
    return allowed


class ConversionError(LexError):
    """A checkpoint or folder that cannot be converted; the message names the key, option or path at fault."""


def refuse_field(config, field: str, why: str) -> NoReturn:
    """A LexConfig field the target architecture cannot compute: its name, its value and why."""
    raise ConversionError(f"LexConfig.{field}={getattr(config, field)!r}: {why}")


def check_tensors(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], heading: str,
                  source_name: Callable[[str], str] = str, unexpected: Iterable[str] = (), noun: str = "tensors",
                  needs: str = "the config needs", limit: int | None = None) -> None:
    """Every tensor of `expected` once, nothing else, every shape right; else one ConversionError
    `heading: missing ...; unexpected ...; shape mismatches: ...`.

    `shapes` and `expected` map the target's tensor names to shapes; the message names each tensor as the source
    does (`source_name` of a target name), plus `unexpected`: the source's names that have no target name at all.
    Each list shows at most `limit` names (None: all)."""
    missing = [source_name(name) for name in expected if name not in shapes]
    unexpected = [*unexpected, *(source_name(name) for name in shapes if name not in expected)]
    mismatched = [f"{source_name(name)} is {shape}, {needs} {expected[name]}" for name, shape in shapes.items()
                  if name in expected and tuple(shape) != tuple(expected[name])]
    problems = [f"{what}: {', '.join(items[:limit])}{' ...' if limit and len(items) > limit else ''}"
                for what, items in ((f"missing {noun}", missing), (f"unexpected {noun}", unexpected),
                                    ("shape mismatches", mismatched)) if items]
    if problems:
        raise ConversionError(f"{heading}: " + "; ".join(problems))


def load_checkpoint(path: Path) -> object:
    """torch.load with weights_only=True and the data types of `safe_globals`: nothing in it can run code."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: no such checkpoint file")
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        message = str(error)
        named = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"but got <class '([\w.]+)'>", message)
        culprit = f"it asks for {named.group(1)}" if named else message.strip().splitlines()[0]
        raise ConversionError(
            f"refusing to load {path}: it pickles more than tensors and plain containers, and unpickling it could "
            f"run code ({culprit}). Save weights only, e.g. torch.save(decoder.state_dict(), PATH)"
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise ConversionError(f"{path} is not a readable torch checkpoint: {error}") from None


class Unresolved(str):
    """An omegaconf "${...}" reference this converter could not resolve; an error only if the option is used."""


def resolve_interpolations(section: dict, root: dict) -> dict:
    """Resolve whole-value references like "${model.decoder_embed_dim}" or "${task.tokens_per_sample}".

    fairseq writes its dataclass config with such references: absolute paths into the whole `cfg` dict, or
    "${.key}" relative to `section`. Others become `Unresolved`, an error only if the converter needs them.
    """

    def lookup(reference: str, seen: tuple[str, ...]):
        if reference in seen or reference.startswith(".."):
            return Unresolved(f"${{{reference}}}")
        node = section if reference.startswith(".") else root
        for part in reference.lstrip(".").split("."):
            if not isinstance(node, dict) or part not in node:
                return Unresolved(f"${{{reference}}}")
            node = node[part]
        return resolve(node, (*seen, reference))

    def resolve(value, seen: tuple[str, ...] = ()):
        match = re.fullmatch(r"\$\{([\w.]+)\}", value.strip()) if isinstance(value, str) else None
        return lookup(match.group(1), seen) if match else value

    return {key: resolve(value) for key, value in section.items()}
