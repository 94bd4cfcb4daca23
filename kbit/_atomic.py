"""Atomic replacement of a directory: a save either fully happens or leaves the old one untouched.

Every file of a save is written into a temporary sibling directory (same filesystem, so renames are
atomic). When the writer finishes, the temporary directory takes the target's place:

* no target yet: one ``rename``;
* a target exists: Linux ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one step, then
  the old one (now under the temporary name) is deleted. Where the call is missing (another OS, a
  filesystem without it) the target is renamed aside, the new one renamed in and the old one
  deleted; a crash in that short window leaves the old checkpoint complete as ``.<name>.kbit-old-<pid>``.

Durability: before the swap every file and directory of the new folder is fsynced, and after it the
parent directory, so once the save returns the new checkpoint survives a power loss (on filesystems that
honour fsync); a power loss before it returns leaves the old checkpoint or the new one, never a mix.

A target that is a symbolic link is written through: the folder it names is replaced, the link stays.
A target the user cannot modify (a write-protected folder or subfolder, whose old files could not be
deleted after the swap) is refused with ``PermissionError`` before anything is written.

Files of the old directory that the new save does not write (a tokenizer, a README) are carried
over by hard link (copy where links fail), except the old checkpoint's own weights and index
files, which would otherwise mix two checkpoints.

A process killed while writing leaves its temporary directory behind; the next save into the same
parent deletes it. Whether its save still runs is told by a lock, not by a process id (which means
nothing in another PID namespace, say another container sharing the volume): each save holds an
``flock`` on ``<temporary directory>.lock`` until it ends, the kernel releases it when the process dies,
and only a temporary directory whose lock can be taken is deleted. Where the filesystem has no locks,
nothing is deleted automatically.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # no flock on this OS: temporaries are never proven abandoned, so never deleted
    fcntl = None

_TMP_MARK = ".kbit-tmp-"
_LOCK_SUFFIX = ".lock"  # <temporary directory>.lock, held (flock) by the save writing that directory
_OLD_MARK = ".kbit-old-"  # the fallback's old directory: never deleted automatically, it may be all that is left
# Files of an old checkpoint that a new save replaces as a whole, never carries over.
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json",
                    "generation_config.json", "kbit_config.json")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _lock_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + _LOCK_SUFFIX)


def _names_open_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a cleanup may have deleted it meanwhile)."""
    try:
        st, fst = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _lock(fd: int, wait: bool) -> bool:
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:  # held by a live save, or a filesystem without locks: either way not ours to take
        return False
    return True


def _claim_temporary(target: Path):
    """A new temporary directory for a save into ``target`` and the open, locked file that marks it live."""
    while True:
        tmp = target.parent / f".{target.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        lock = _lock_path(tmp)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        _lock(fd, wait=True)
        # A cleanup that took the fresh lock file before we locked it has deleted it: start over under a new name.
        if _names_open_file(lock, fd):
            tmp.mkdir()
            return tmp, fd
        os.close(fd)


def _release_temporary(tmp: Path, fd: int) -> None:
    if not tmp.exists():  # else keep the lock file, so that a later save deletes what is left
        _lock_path(tmp).unlink(missing_ok=True)
    os.close(fd)


def remove_stale_temporaries(target: Path) -> list:
    """Delete temporary directories of saves into ``target`` whose save no longer runs (nobody holds its lock)."""
    removed = []
    prefix = f".{target.name}{_TMP_MARK}"
    if not target.parent.is_dir():
        return removed
    for lock in target.parent.iterdir():
        if not (lock.name.startswith(prefix) and lock.name.endswith(_LOCK_SUFFIX)):
            continue
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # deleted meanwhile, or another user's
            continue
        try:
            if not (_lock(fd, wait=False) and _names_open_file(lock, fd)):
                continue
            tmp = lock.with_name(lock.name[:-len(_LOCK_SUFFIX)])
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                lock.unlink(missing_ok=True)
                removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def _check_replaceable(target: Path) -> None:
    """Refuse a target whose old files this user could not delete after the swap (root may delete anything)."""
    for root, _, _ in os.walk(target):
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot replace {target}: {root} is write-protected, so its old files could not "
                                  "be deleted; nothing was written")


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


def fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """fsync every file, then every directory bottom-up (a directory's fsync makes its entries durable)."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(root)


def _remove_old(old: Path) -> None:
    shutil.rmtree(old, ignore_errors=True)
    if old.exists():
        warnings.warn(f"kbit: the previous checkpoint could not be deleted completely; what is left of it is in {old}",
                      RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def atomic_directory(target) -> Iterator[Path]:
    """Yield a temporary directory to write into; on success it replaces ``target`` atomically.

    On an exception the temporary directory is deleted and ``target`` is left as it was. A symbolic link
    ``target`` is written through (the folder it names is replaced); see the module docstring.
    """
    target = Path(os.path.realpath(target))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory")
    if target.is_dir():
        _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp, lock_fd = _claim_temporary(target)
    try:
        yield tmp
        if target.is_dir():
            _carry_over(target, tmp)
        _fsync_tree(tmp)
        _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _release_temporary(tmp, lock_fd)


def _replace(tmp: Path, target: Path) -> None:
    """Put ``tmp`` in ``target``'s place, make the parent's entries durable, then delete the old directory."""
    if not target.exists():
        os.rename(tmp, target)
        fsync_path(target.parent)
        return
    if _exchange(tmp, target):
        fsync_path(target.parent)
        _remove_old(tmp)  # tmp now names the old directory
        return
    aside = target.parent / f".{target.name}{_OLD_MARK}{os.getpid()}"
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside, target)
        raise
    fsync_path(target.parent)
    _remove_old(aside)
