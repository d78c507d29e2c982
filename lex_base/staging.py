"""Every folder and file the project writes appears only when complete: it is written into a hidden staging
folder beside its destination and moved into place by rename, so a crash, a kill or a full disk leaves the
previous output as it was (and at worst a hidden `.NAME.partial-*` folder).

A staging folder's name records who made it: `.NAME.partial-HOST-PID-RANDOM` (HOST: 8 hex digits of the
machine's name). A process killed without a chance to clean up (SIGKILL, a power cut) leaves its folder
behind; the next staging for the same NAME removes it once that process no longer exists on this machine. A
live process's folder, or one made on another machine (a shared file system), is never touched. Written
files and folders get the user's normal modes (umask), whatever mode the writer gave its temporary files.
"""

import ctypes
import ctypes.util
import glob
import hashlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputExistsError

_RENAME_EXCHANGE = 2  # linux/fs.h
# .NAME.partial-HOST-PID-RANDOM, and its "-old" twin while an existing folder is swapped out
STAGING_NAME = re.compile(r"^\..+\.partial-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]+(-old)?$")


def host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def is_staging(name: str) -> bool:
    """Whether `name` is a staging folder of this module (any process's): never part of an output."""
    return bool(STAGING_NAME.match(name)) or bool(re.match(r"^\..+\.partial-[0-9a-f]{12}(-old)?$", name))


def process_exists(pid: int) -> bool:
    """Whether process `pid` exists on this machine and can still run its own clean-up (a zombie cannot)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove the staging folders for `target` left by processes of this machine that no longer exist."""
    target = Path(target).absolute()
    removed, host = [], host_tag()
    for path in target.parent.glob(f".{glob.escape(target.name)}.partial-*"):
        match = STAGING_NAME.match(path.name)
        if not match or match["host"] != host or process_exists(int(match["pid"])):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def make_staging(target: Path) -> Path:
    """A new hidden folder beside `target` (same file system, so the final rename is atomic; mode from umask),
    after removing the stale ones of dead processes."""
    target = Path(target).absolute()
    remove_stale_staging(target)
    staging = target.with_name(f".{target.name}.partial-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    return staging


def current_umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it (and put it back at once)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give `root` and everything under it the modes a plain write would have: 0666 (0777 for folders and
    executables) less the umask. Writers that stage through temporary files leave 0600 otherwise."""
    mask = current_umask()
    for path in [Path(root), *Path(root).rglob("*")]:
        if path.is_symlink():
            continue
        executable = path.is_dir() or path.stat().st_mode & 0o111
        os.chmod(path, (0o777 if executable else 0o666) & ~mask)


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
        raise OutputExistsError(f"{out_dir} exists; pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging(out_dir)
    try:
        yield staging
        apply_umask(staging)
        _replace_directory(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_files(folder: str | Path, names: tuple[str, ...] = (), force: bool = True) -> Iterator[Path]:
    """Yield a staging folder; on success every file written there is moved into `folder`, config.json (or a
    peft adapter's adapter_config.json) last (so a folder never looks loadable before its weights are in place).

    `names` are the files the caller will write: existing ones are refused (FileExistsError) unless `force`.
    """
    folder = Path(folder).absolute()
    existing = [str(folder / name) for name in names if (folder / name).exists()]
    if existing and not force:
        raise OutputExistsError(f"refusing to overwrite {', '.join(existing)}; pass --force to replace")
    folder.mkdir(parents=True, exist_ok=True)
    staging = make_staging(folder / "files")
    try:
        yield staging
        apply_umask(staging)
        configs = ("config.json", "adapter_config.json")
        for name in sorted((p.name for p in staging.iterdir()), key=lambda name: name in configs):
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
