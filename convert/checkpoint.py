"""Reading checkpoints without running their pickles, and writing outputs that appear only when complete."""

import os
import pickle
import re
import shutil
import uuid
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


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


class ConversionError(ValueError):
    """A checkpoint or folder that cannot be converted; the message names the key, option or path at fault."""


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


def make_staging(target: Path) -> Path:
    """A new hidden folder beside `target` (same file system, so the final rename is atomic; mode from umask)."""
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:12]}")
    staging.mkdir()
    return staging


@contextmanager
def atomic_directory(out_dir: Path, force: bool) -> Iterator[Path]:
    """Yield an empty staging folder beside `out_dir`; it becomes `out_dir` only if the block completes.

    An existing `out_dir` is replaced only with `force`, and only after the new one is complete.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise ConversionError(f"{out_dir} exists; pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging(out_dir)
    try:
        yield staging
        if out_dir.exists():
            old = staging.with_name(staging.name + "-old")
            out_dir.rename(old)
            staging.rename(out_dir)
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_files(targets: list[Path], force: bool) -> Iterator[Path]:
    """Yield a staging folder; files written there under the targets' names replace the targets on success."""
    targets = [Path(t) for t in targets]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not force:
        raise ConversionError(f"refusing to overwrite {', '.join(existing)}; pass --force to replace")
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging(targets[0])
    try:
        yield staging
        for target in targets:
            os.replace(staging / target.name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
