"""Every folder and file the project writes appears only when complete: it is written into a hidden staging
folder beside its destination and moved into place by rename, so a crash, a kill or a full disk leaves the
previous output as it was (and at worst a hidden `.NAME.partial-*` folder).
"""

import ctypes
import ctypes.util
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_RENAME_EXCHANGE = 2  # linux/fs.h


def make_staging(target: Path) -> Path:
    """A new hidden folder beside `target` (same file system, so the final rename is atomic; mode from umask)."""
    target = Path(target).absolute()
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:12]}")
    staging.mkdir()
    return staging


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd = -100
    return renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), _RENAME_EXCHANGE) == 0


def _replace_directory(staging: Path, out_dir: Path) -> None:
    """Put the complete `staging` at `out_dir`, replacing an existing one without a moment where neither exists
    (where the system cannot swap two folders atomically, the old one is first renamed aside, never deleted
    before the new one is in place)."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    if not _exchange(staging, out_dir):
        old = staging.with_name(staging.name + "-old")
        out_dir.rename(old)
        staging.rename(out_dir)
        staging = old
    if staging.is_dir():
        shutil.rmtree(staging)
    else:
        staging.unlink()


@contextmanager
def atomic_directory(out_dir: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder; it becomes `out_dir` only if the block completes.

    An existing `out_dir` is refused (FileExistsError) unless `force`, and replaced only once the new one is
    complete.
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging(out_dir)
    try:
        yield staging
        _replace_directory(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_files(folder: str | Path, names: tuple[str, ...] = (), force: bool = True) -> Iterator[Path]:
    """Yield a staging folder; on success every file written there is moved into `folder`, config.json last
    (so a folder never looks loadable before its weights are in place).

    `names` are the files the caller will write: existing ones are refused (FileExistsError) unless `force`.
    """
    folder = Path(folder).absolute()
    existing = [str(folder / name) for name in names if (folder / name).exists()]
    if existing and not force:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}; pass --force to replace")
    folder.mkdir(parents=True, exist_ok=True)
    staging = make_staging(folder / "files")
    try:
        yield staging
        for name in sorted((p.name for p in staging.iterdir()), key=lambda name: name == "config.json"):
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
