"""Atomic writes: a crash or an exception leaves either the old content or the new one, never a half-written
file and never a missing target.

A file is written to a temporary file beside it and renamed onto it. A folder is built in a temporary
sibling and swapped in with one exchange rename (Linux ``renameat2(RENAME_EXCHANGE)``); without one, the
swap is journalled in the names (``.NAME.loragen-PID-X.new`` / ``.old``) and the next write to that target
finishes or rolls back a swap that was cut off. Writers to one target serialise on ``flock`` of its parent
folder, and delete loragen's temporaries (``.NAME.loragen-PID-RANDOM.tmp``) that killed writers left.
Written files get the mode of the file they replace, else what the umask gives a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loragen.errors import LoraError

try:
    import fcntl
except ImportError:  # not on Windows: writers are then not serialised
    fcntl = None  # type: ignore[assignment]

__all__ = ["WriteError", "atomic_write_bytes", "atomic_write_text", "atomic_file", "atomic_dir"]


class WriteError(LoraError, OSError):
    """A file or folder cannot be written where asked (a link, not a folder, no space...); an ``OSError``."""


def _umask() -> int:
    """The process umask (read without changing it where the platform allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it, and put it back at once
    os.umask(mask)
    return mask


def _final_mode(target: Path, is_dir: bool) -> int:
    """The mode of the existing ``target`` if there is one, else what the umask gives a new one."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        return (0o777 if is_dir else 0o666) & ~_umask()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform / filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass
class _FolderLock:
    """A process-wide reentrant lock on one folder, holding ``flock`` on it while any thread holds it."""

    thread_lock: threading.RLock = field(default_factory=threading.RLock)
    depth: int = 0
    fd: int | None = None


_LOCKS: dict[str, _FolderLock] = {}
_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[bool]:
    """Hold the writers' lock of ``folder`` (``flock`` on it, reentrant in a process); yields whether
    other processes are locked out too (where ``flock`` is unavailable only threads are)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(os.path.realpath(folder), _FolderLock())
    with lock.thread_lock:
        if lock.depth == 0 and fcntl is not None:
            with contextlib.suppress(OSError):  # an unreadable folder, a filesystem without flock
                fd = os.open(folder, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:
                    os.close(fd)
                    raise
                lock.fd = fd
        lock.depth += 1
        try:
            yield lock.fd is not None
        finally:
            lock.depth -= 1
            if lock.depth == 0 and lock.fd is not None:
                os.close(lock.fd)  # closing the last descriptor releases the flock
                lock.fd = None


def _temp_name(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.loragen-{os.getpid()}-{secrets.token_hex(4)}.{kind}")


def _own_temporaries(target: Path) -> dict[str, list[Path]]:
    """loragen's temporary entries for ``target`` in its folder, by kind (``tmp``, ``new``, ``old``)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.loragen-\d+-[0-9a-f]+\.(tmp|new|old)")
    found: dict[str, list[Path]] = {"tmp": [], "new": [], "old": []}
    with contextlib.suppress(OSError):
        for name in os.listdir(target.parent):
            if match := pattern.fullmatch(name):
                found[match.group(1)].append(target.parent / name)
    for paths in found.values():
        paths.sort(key=lambda p: p.lstat().st_mtime if p.exists() else 0.0)
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _recover_and_clean(target: Path) -> None:
    """Finish a folder swap a killed writer cut off (the target missing: ``.new`` is put in place, else
    ``.old`` back), then delete its leftovers (lock held)."""
    found = _own_temporaries(target)
    if not os.path.lexists(target):
        for candidate in (*reversed(found["new"]), *reversed(found["old"])):
            with contextlib.suppress(OSError):
                os.rename(candidate, target)
                break
    for paths in found.values():
        for path in paths:
            if os.path.lexists(path) and path != target:
                _remove(path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYSCALL_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347, "riscv64": 276}


def _libc_renameat2() -> object | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    arguments = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = arguments
        function.restype = ctypes.c_int
        return function
    number = _SYSCALL_RENAMEAT2.get(os.uname().machine) if hasattr(os, "uname") else None
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.argtypes = [ctypes.c_long, *arguments]  # syscall(number, then renameat2's arguments)
    syscall.restype = ctypes.c_long
    return functools.partial(syscall, number)


_RENAMEAT2 = _libc_renameat2() if os.name == "posix" else None


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the system or filesystem cannot."""
    if _RENAMEAT2 is None:
        return False
    ctypes.set_errno(0)
    result = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise WriteError(code, f"cannot swap {b} for its new content: {os.strerror(code)}", str(b))


@contextlib.contextmanager
def _locked(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield ``path`` made absolute (links not followed) with its folder's writers' lock held and the
    leftovers of killed writers to it cleaned; refuses a path naming no entry of a folder."""
    raw = os.fspath(path)
    target = Path(os.path.abspath(raw))
    if not raw or Path(raw).name in ("", ".", "..") or target.name in ("", ".", ".."):
        raise WriteError(
            errno.EINVAL, f"{raw!r} names no file or folder of its own: give a path ending in a name"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with _folder_locked(target.parent) as exclusive:
        if exclusive:
            _recover_and_clean(target)
        yield target


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the caller to write; on success it is fsynced, given its
    final mode and renamed onto ``path``; on an exception it is removed and ``path`` is untouched.

    Raises:
        WriteError: ``path`` names no file (``""``, ``.``, ``..``), or the file cannot be renamed into place.
    """
    with _locked(path) as target:
        tmp = _temp_name(target, "tmp")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            yield tmp
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, _final_mode(target, is_dir=False))
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically; see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding))


def _finish_files(tmp: Path, target: Path) -> None:
    """fsync every file built in ``tmp`` and give it the mode the same file has under ``target``."""
    for root, _, files in os.walk(tmp):
        relative = Path(root).relative_to(tmp)
        if relative != Path("."):
            os.chmod(root, _final_mode(target / relative, is_dir=True))
        for name in files:
            child = Path(root) / name
            if child.is_symlink():
                continue
            with open(child, "rb") as fh:
                os.fsync(fh.fileno())
            # not the writer's mode (safetensors writes 0600): the replaced file's, else the umask's
            os.chmod(child, _final_mode(target / relative / name, is_dir=False))
    os.chmod(tmp, _final_mode(target, is_dir=True))


def _swap_in(tmp: Path, target: Path) -> None:
    """Put the complete folder ``tmp`` at ``target`` with no moment where ``target`` is missing."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):
        _remove(tmp)  # the old content, now under the temporary name
        return
    new = _temp_name(target, "new")
    old = _temp_name(target, "old")
    os.rename(tmp, new)  # the journal: a complete new folder exists
    os.rename(target, old)
    os.rename(new, target)
    _remove(old)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder atomically: yield an empty temporary folder beside ``path``, swap it in on success.

    Its files get the mode the same file had in the folder replaced, else the umask's. ``path`` always
    holds the old or the new folder; on an exception the temporary folder is removed.

    Raises:
        WriteError: ``path`` names no folder (``""``, ``.``, ``..``), is a symbolic link, or exists and is
            not a folder; or the new folder cannot be swapped in (the old one is then in place).
    """
    with _locked(path) as target:
        if target.is_symlink():
            raise WriteError(
                errno.EEXIST,
                f"{target} is a symbolic link (to {os.readlink(target)}); refusing to replace it: write to "
                "the folder it points to, or remove the link",
            )
        if target.exists() and not target.is_dir():
            raise WriteError(errno.ENOTDIR, f"{target} exists and is not a folder; refusing to replace it")
        tmp = _temp_name(target, "tmp")
        tmp.mkdir(mode=0o700)
        try:
            yield tmp
            _finish_files(tmp, target)
            _swap_in(tmp, target)
        except BaseException:
            _remove(tmp)
            raise
        _fsync_dir(target.parent)
