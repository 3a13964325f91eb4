"""Atomic writes that touch only what they write: a crash or an exception leaves each file with its old
content or its new one, never half-written and never missing, and leaves every other file alone.

A file is written to a temporary file beside it (``.NAME.loragen-PID-RANDOM.tmp``), fsynced and renamed
onto it, so files other programs create in the same folder meanwhile (loggers, other ranks' checkpoint
files) stay. :func:`locked_folder` opens a folder without following a link and holds its writers' lock
(``flock(LOCK_EX)`` on the folder itself, reentrant within a process); :meth:`Folder.subfolder` opens a
subfolder the same way, so a check that it is no link holds when the write happens, and
:meth:`Folder.write_files` replaces several files by name relative to the open folder, every temporary
complete and fsynced before the first rename (a writer killed between two renames leaves the rest of its
new content complete in :func:`leftover_temporaries`). Readers that need a stable view of several files
(an adapter's config and weights) hold :func:`shared_lock` of the folder: no writer renames meanwhile.
A writer deletes the temporaries killed writers left for the names it writes.

:func:`atomic_dir` builds a whole folder and swaps it in (one exchange rename, or a swap journalled in the
names that the next write finishes). Removing a folder never follows a link and never enters another
mount: a folder holding a mount point is not replaced. Written files get the mode of the file they
replace, else what the umask gives a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loragen.errors import LoraError

try:
    import fcntl
except ImportError:  # not on Windows: writers are then serialised only within a process
    fcntl = None  # type: ignore[assignment]

# (flags a platform lacks are 0: on Windows folders are then opened as paths are)
_O_DIRECTORY, _O_NOFOLLOW, _O_CLOEXEC = (
    getattr(os, f"O_{n}", 0) for n in ("DIRECTORY", "NOFOLLOW", "CLOEXEC")
)

__all__ = [
    "WriteError",
    "Folder",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_file",
    "atomic_dir",
    "leftover_temporaries",
    "locked_folder",
    "shared_lock",
]


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


# ---- the writers' lock -------------------------------------------------------------------------------


@dataclass
class _FolderLock:
    """A process-wide reentrant lock on one folder (by device and inode), holding ``flock`` on it while any
    thread holds it; ``owner``: the thread holding it."""

    thread_lock: threading.RLock = field(default_factory=threading.RLock)
    depth: int = 0
    fd: int | None = None
    owner: int | None = None


_LOCKS: dict[tuple[int, int], _FolderLock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock_of(fd: int) -> _FolderLock:
    info = os.fstat(fd)
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((info.st_dev, info.st_ino), _FolderLock())


@contextlib.contextmanager
def _exclusive(fd: int) -> Iterator[bool]:
    """Hold the writers' lock of the folder open as ``fd``; yields whether other processes are locked out
    too (not where the filesystem or platform has no ``flock``)."""
    lock = _lock_of(fd)
    with lock.thread_lock:
        if lock.depth == 0 and fcntl is not None:
            with contextlib.suppress(OSError):  # a filesystem without flock: threads only
                fcntl.flock(fd, fcntl.LOCK_EX)
                lock.fd = fd
        lock.depth += 1
        lock.owner = threading.get_ident()
        try:
            yield lock.fd is not None
        finally:
            lock.depth -= 1
            if lock.depth == 0:
                lock.owner = None
                if lock.fd is not None:
                    with contextlib.suppress(OSError):
                        fcntl.flock(lock.fd, fcntl.LOCK_UN)
                    lock.fd = None


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[bool]:
    """Hold the writers' lock of ``folder`` (see :func:`_exclusive`); False where it cannot be opened."""
    try:
        fd: int | None = os.open(folder, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError:  # an unreadable folder: no lock to take
        fd = None
    if fd is None:
        yield False
        return
    try:
        with _exclusive(fd) as exclusive:
            yield exclusive
    finally:
        os.close(fd)


@contextlib.contextmanager
def shared_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold a reader's lock on the folder ``path`` (``flock(LOCK_SH)``): while it is held no loragen writer
    renames a file into the folder, so several files read together come from one write. Waits while a
    writer holds the lock. No lock where the folder cannot be opened (the reader then reads as is), and none
    needed where this thread holds the writers' lock of the folder itself."""
    try:
        fd: int | None = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError:
        fd = None
    try:
        if fd is not None and fcntl is not None and _lock_of(fd).owner != threading.get_ident():
            with contextlib.suppress(OSError):  # a filesystem without flock: read unlocked
                fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the flock


# ---- temporaries and removal -------------------------------------------------------------------------


def _temp_name(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.loragen-{os.getpid()}-{secrets.token_hex(4)}.{kind}")


def _temporaries_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.loragen-\d+-[0-9a-f]+\.(tmp|new|old)")


def _own_temporaries(target: Path) -> dict[str, list[Path]]:
    """loragen's temporary entries for ``target`` in its folder, by kind (``tmp``, ``new``, ``old``)."""
    pattern = _temporaries_pattern(target.name)
    found: dict[str, list[Path]] = {"tmp": [], "new": [], "old": []}
    with contextlib.suppress(OSError):
        for name in os.listdir(target.parent):
            if match := pattern.fullmatch(name):
                found[match.group(1)].append(target.parent / name)
    for paths in found.values():
        paths.sort(key=lambda p: p.lstat().st_mtime if p.exists() else 0.0)
    return found


def leftover_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """loragen's temporary files for the file ``path`` in its folder, newest first: a live writer's, or
    what a killed writer left (complete or not: a reader checks the content before using it)."""
    target = Path(path)
    found = _own_temporaries(target)["tmp"]
    return [p for p in reversed(found) if p.is_file() and not p.is_symlink()]


def _mount_points() -> frozenset[str]:
    """The mount points of this process (Linux ``/proc/self/mountinfo``; empty elsewhere)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
            points = [line.split()[4] for line in info if len(line.split()) > 4]
    except OSError:
        return frozenset()
    # the file escapes space, tab, newline and backslash as \ooo
    return frozenset(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points)


def _mount_inside(path: Path) -> Path | None:
    """A mount point inside the folder ``path`` (links not followed), or None."""
    root = os.lstat(path)
    points = _mount_points()
    real = os.path.realpath(path)
    for point in points:
        if point.startswith(real.rstrip("/") + "/"):
            return Path(path) / os.path.relpath(point, real)
    stack = [Path(path)]
    while stack:
        folder = stack.pop()
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            child = folder / name
            with contextlib.suppress(OSError):
                info = os.lstat(child)
                if stat.S_ISDIR(info.st_mode) and info.st_dev != root.st_dev:
                    return child
                if stat.S_ISDIR(info.st_mode):
                    stack.append(child)
    return None


_OPEN_FOLDER = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC


def _remove_tree_at(
    parent_fd: int | None, name: str, shown: Path, device: int, points: frozenset[str]
) -> bool:
    """Delete the folder ``name`` (in ``parent_fd``) and its tree without following a link or entering
    another mount; True if it is gone (a mount point, and the folders holding it, are kept)."""
    if os.path.realpath(shown) in points:
        return False
    try:
        fd = os.open(name, _OPEN_FOLDER, dir_fd=parent_fd)
    except OSError:
        return False
    complete = True
    try:
        if os.fstat(fd).st_dev != device:
            return False
        for child in os.listdir(fd):
            try:
                info = os.stat(child, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode):
                    os.unlink(child, dir_fd=fd)
                elif info.st_dev != device:
                    complete = False
                else:
                    complete &= _remove_tree_at(fd, child, shown / child, device, points)
            except OSError:
                complete = False
    finally:
        os.close(fd)
    if complete:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except OSError:
            return False
    return complete


def _remove(path: Path) -> None:
    """Delete ``path``: a file or a link is unlinked (never followed); a folder with its tree, never
    following a link nor entering another mount (a mount point and the folders holding it are kept)."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(info.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    _remove_tree_at(None, os.fspath(path), path, info.st_dev, _mount_points())


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


# ---- per-file writes into an open folder --------------------------------------------------------------


def _target(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute (links not followed); refuses a path naming no entry of a folder."""
    raw = os.fspath(path)
    target = Path(os.path.abspath(raw))
    if not raw or Path(raw).name in ("", ".", "..") or target.name in ("", ".", ".."):
        raise WriteError(
            errno.EINVAL, f"{raw!r} names no file or folder of its own: give a path ending in a name"
        )
    return target


def _check_entry_name(name: str, folder: Path) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise WriteError(errno.EINVAL, f"{folder}: {name!r} is not a name of an entry of the folder")


def _open_folder(shown: Path, name: str, dir_fd: int | None) -> int:
    """Open the folder ``name`` (in ``dir_fd``; ``shown`` for messages), created if missing, never through
    a link at its last component."""
    for _ in range(2):
        try:
            return os.open(name, _OPEN_FOLDER, dir_fd=dir_fd)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=dir_fd)  # the umask applies
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise WriteError(exc.errno, f"{shown}: cannot open the folder ({exc.strerror})") from None
            where = None
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    where = os.readlink(name, dir_fd=dir_fd)
            if where is not None:
                raise WriteError(
                    errno.ELOOP,
                    f"{shown} is a symbolic link (to {where}); refusing to write through it, outside the "
                    "folder: remove the link or write elsewhere",
                ) from None
            raise WriteError(
                errno.ENOTDIR, f"{shown} exists and is not a folder; refusing to write into it"
            ) from None
    raise WriteError(errno.ENOENT, f"{shown}: the folder disappeared while it was being created")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(frozen=True)
class Folder:
    """A folder opened without following a link, with its writers' lock held (:func:`locked_folder`,
    :meth:`subfolder`); ``fd`` is valid inside the ``with`` block that yielded it."""

    path: Path
    fd: int

    @contextlib.contextmanager
    def subfolder(self, name: str) -> Iterator[Folder]:
        """The subfolder ``name`` (created if missing), opened without following a link and with its own
        writers' lock held too: what is written into it stays in this folder's tree.

        Raises:
            WriteError: ``name`` is a symbolic link or not a folder (checked now, under the lock).
        """
        _check_entry_name(name, self.path)
        fd = _open_folder(self.path / name, name, self.fd)
        try:
            with _exclusive(fd):
                yield Folder(self.path / name, fd)
        finally:
            os.close(fd)

    def _mode(self, name: str) -> int:
        """The mode of the regular file ``name`` replaced, else what the umask gives a new one."""
        with contextlib.suppress(OSError):
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode):
                return info.st_mode & 0o7777
        return 0o666 & ~_umask()

    def _clean(self, name: str) -> None:
        """Delete the temporaries killed writers left for ``name`` (never a live writer's: lock held)."""
        pattern = _temporaries_pattern(name)
        with contextlib.suppress(OSError):
            for entry in os.listdir(self.fd):
                if not pattern.fullmatch(entry):
                    continue
                with contextlib.suppress(OSError):
                    info = os.stat(entry, dir_fd=self.fd, follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode):
                        _remove_tree_at(self.fd, entry, self.path / entry, info.st_dev, _mount_points())
                    else:
                        os.unlink(entry, dir_fd=self.fd)

    def write_files(self, files: Sequence[tuple[str, bytes]]) -> None:
        """Replace the files ``name`` of this folder with ``data``, renaming them into place in the order
        given, after every temporary is written and fsynced: a writer killed between two renames leaves the
        files renamed new, the others old, and their new content complete in :func:`leftover_temporaries`.
        A link at ``name`` is replaced, never written through; nothing else in the folder is touched.

        Raises:
            WriteError: a name is not an entry name.
            OSError: a file cannot be written (no space...): the files not yet renamed are unchanged.
        """
        names = [name for name, _ in files]
        for name in names:
            _check_entry_name(name, self.path)
            self._clean(name)
        staged: list[str] = []
        renamed = 0
        try:
            for name, data in files:
                tmp = _temp_name(self.path / name, "tmp").name
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
                fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
                staged.append(tmp)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                    os.fchmod(fd, self._mode(name))
                finally:
                    os.close(fd)
            for name, tmp in zip(names, staged):
                os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                renamed += 1
        except BaseException:
            if not renamed:  # after the first rename the others stay complete; the next write cleans them
                for tmp in staged:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=self.fd)
            raise
        with contextlib.suppress(OSError):  # not supported on every platform / filesystem
            os.fsync(self.fd)


@contextlib.contextmanager
def locked_folder(path: str | os.PathLike[str]) -> Iterator[Folder]:
    """Open the folder ``path`` (created with its parents if missing), never through a link at its last
    component, and hold its writers' lock (``flock(LOCK_EX)`` on it) until the block ends.

    Raises:
        WriteError: ``path`` names no folder (``""``, ``.``, ``..``), is a symbolic link, is not a folder,
            or cannot be created.
    """
    target = _target(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(exc.errno, f"{target.parent}: cannot create the folder ({exc.strerror})") from None
    fd = _open_folder(target, os.fspath(target), None)
    try:
        with _exclusive(fd):
            yield Folder(target, fd)
    finally:
        os.close(fd)


# ---- whole files and folders by path ---------------------------------------------------------------------


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
    target = _target(path)
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
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600))
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
        WriteError: ``path`` names no folder (``""``, ``.``, ``..``), is a symbolic link, exists and is
            not a folder, or holds a mount point; or the new folder cannot be swapped in (the old one is
            then in place).
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
        if target.is_dir() and (mount := _mount_inside(target)) is not None:
            raise WriteError(
                errno.EBUSY,
                f"{mount} is a mount point; refusing to replace {target}, which holds it (its volume would "
                "be emptied): unmount it, or write elsewhere",
            )
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
