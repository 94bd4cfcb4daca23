"""Atomic replacement of a directory: a save either fully happens or leaves the old one untouched.

Every file of a save is written into a temporary sibling directory (same filesystem, so renames are
atomic). When the writer finishes, the temporary directory takes the target's place:

* no target yet: one ``rename``;
* a target exists: Linux ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one step, then
  the old one (now under the temporary name) is deleted. Where the call is missing (another OS, a
  filesystem without it) the target is renamed aside, the new one renamed in and the old one
  deleted; a crash in that short window leaves the old checkpoint complete as ``.<name>.kbit-old-<pid>``.

Files of the old directory that the new save does not write (a tokenizer, a README) are carried
over by hard link (copy where links fail), except the old checkpoint's own weights and index
files, which would otherwise mix two checkpoints.

A process killed while writing leaves only its temporary directory behind; the next save into the
same parent deletes temporary directories whose owner process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

_TMP_MARK = ".kbit-tmp-"
_OLD_MARK = ".kbit-old-"  # the fallback's old directory: never deleted automatically, it may be all that is left
# Files of an old checkpoint that a new save replaces as a whole, never carries over.
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json",
                    "generation_config.json", "kbit_config.json")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _temp_name(target: Path) -> Path:
    return target.parent / f".{target.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(target: Path) -> list:
    """Delete temporary directories of saves into ``target`` whose process no longer runs."""
    removed = []
    prefix = f".{target.name}{_TMP_MARK}"
    if not target.parent.is_dir():
        return removed
    for p in target.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not supported by this kernel or filesystem
        return False
    raise OSError(err, os.strerror(err), str(b))


def _carry_over(old: Path, new: Path) -> None:
    for p in old.iterdir():
        if (new / p.name).exists():
            continue
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in CHECKPOINT_FILES):
            continue
        if p.is_dir():
            shutil.copytree(p, new / p.name, symlinks=True)
            continue
        try:
            os.link(p, new / p.name)
        except OSError:
            shutil.copy2(p, new / p.name)


def _fsync_tree(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_directory(target) -> Iterator[Path]:
    """Yield a temporary directory to write into; on success it replaces ``target`` atomically.

    On an exception the temporary directory is deleted and ``target`` is left as it was.
    """
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = _temp_name(target)
    tmp.mkdir()
    try:
        yield tmp
        if target.is_dir():
            _carry_over(target, tmp)
        _fsync_tree(tmp)
        _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now names the old directory
        return
    aside = target.parent / f".{target.name}{_OLD_MARK}{os.getpid()}"
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
