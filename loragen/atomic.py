"""Atomic file writes that touch only what they write: a crash or an exception leaves each file with its old
content or its new one, never half-written and never missing, and leaves every other file alone.

A file is written to a temporary file beside it (``.NAME.loragen-PID-RANDOM.tmp``), fsynced, given the mode
of the file it replaces (else what the umask gives a new one) and renamed onto it, so files other programs
create in the same folder meanwhile (loggers, other ranks' checkpoint files) stay. Writers to a folder take
turns under its :func:`writers_lock`. :func:`atomic_file` writes one file by path; :func:`locked_folder`
opens a folder without following a link, and :meth:`Folder.write_files` replaces several files in it, every
temporary complete before the first rename (a writer killed between two renames leaves the rest of its new
content in :func:`leftover_temporaries`). Readers that need a stable view of several files hold
:func:`shared_lock` of the folder. A writer deletes the temporary files killed writers left for the names it
writes, and nothing else. :func:`mount_points` lists the mount points, for a writer that must not write
into a mounted subfolder.
"""

from __future__ import annotations

import contextlib
import errno
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
_OPEN_FOLDER = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC

__all__ = [
    "WriteError",
    "Folder",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_file",
    "leftover_temporaries",
    "locked_folder",
    "mount_points",
    "shared_lock",
    "writers_lock",
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


def _final_mode(path: str | Path, dir_fd: int | None = None) -> int:
    """The mode of the regular file ``path`` (in ``dir_fd``) that a write replaces, else what the umask gives
    a new one (not the writer's: safetensors and the temporaries are 0600)."""
    with contextlib.suppress(OSError):
        info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            return info.st_mode & 0o7777
    return 0o666 & ~_umask()


def mount_points() -> frozenset[str]:
    """Every mount point of this process (Linux's ``/proc/self/mountinfo``, which also shows bind mounts of a
    folder of the same file system, invisible to ``st_dev``); empty where it cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
            fields = [line.split(" ") for line in info]
    except OSError:
        return frozenset()
    # the mount point is the fifth field, with space, tab, newline and backslash escaped in octal
    return frozenset(
        re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4]) for f in fields if len(f) > 4
    )


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
def writers_lock(folder: str | os.PathLike[str]) -> Iterator[bool]:
    """Hold the writers' lock of the folder ``folder`` (``flock(LOCK_EX)`` on it) until the block ends:
    loragen's writers into the folder (:func:`atomic_file`, :func:`locked_folder`) and its readers
    (:func:`shared_lock`) in other threads and processes wait meanwhile, so several files written in the
    block change together for them. Reentrant within a thread: writes inside the block take it again
    without waiting.

    Yields whether other processes are locked out: False where the filesystem has no ``flock`` (threads of
    this process still take turns) or where ``folder`` cannot be opened (no lock is then held).
    """
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


# ---- temporaries ---------------------------------------------------------------------------------------


def _temp_name(name: str) -> str:
    return f".{name}.loragen-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _temporaries(folder: Path | int, name: str) -> list[tuple[str, os.stat_result]]:
    """loragen's temporary files for the entry ``name`` of ``folder`` (a path, or an open folder's ``fd``):
    each one's path (relative to the ``fd``) and ``lstat``; regular files only, a folder or a link of such a
    name is none of loragen's."""
    pattern = re.compile(rf"\.{re.escape(name)}\.loragen-\d+-[0-9a-f]+\.tmp")
    dir_fd, base = (folder, "") if isinstance(folder, int) else (None, os.fspath(folder))
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder):
            if pattern.fullmatch(entry):
                with contextlib.suppress(OSError):
                    info = os.stat(os.path.join(base, entry), dir_fd=dir_fd, follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode):
                        found.append((os.path.join(base, entry), info))
    return found


def _delete_temporaries(folder: Path | int, name: str) -> None:
    """Delete the temporary files killed writers left for ``name`` in ``folder`` (writers' lock held, so none
    is a live writer's): each is unlinked, nothing is removed recursively."""
    for path, _ in _temporaries(folder, name):
        with contextlib.suppress(OSError):
            os.unlink(path, dir_fd=folder if isinstance(folder, int) else None)


def leftover_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """loragen's temporary files for the file ``path`` in its folder, newest first: a live writer's, or
    what a killed writer left (complete or not: a reader checks the content before using it)."""
    target = Path(path)
    found = sorted(_temporaries(target.parent, target.name), key=lambda item: item[1].st_mtime, reverse=True)
    return [Path(entry) for entry, _ in found]


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
    :meth:`subfolder`); ``fd`` is valid inside the ``with`` block that yielded it. ``exclusive``: whether
    other processes are locked out too (see :func:`writers_lock`)."""

    path: Path
    fd: int
    exclusive: bool

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
            with _exclusive(fd) as exclusive:
                yield Folder(self.path / name, fd, exclusive)
        finally:
            os.close(fd)

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
            if self.exclusive:
                _delete_temporaries(self.fd, name)
        staged: list[str] = []
        renamed = 0
        try:
            for name, data in files:
                tmp = _temp_name(name)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
                fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
                staged.append(tmp)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                    os.fchmod(fd, _final_mode(name, self.fd))
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
        with _exclusive(fd) as exclusive:
            yield Folder(target, fd, exclusive)
    finally:
        os.close(fd)


# ---- one file by path ----------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the caller to write, holding the writers' lock of its
    folder (created with its parents if missing); on success the file is fsynced, given its final mode and
    renamed onto ``path`` (a link there is replaced, not written through); on an exception it is removed
    and ``path`` is untouched.

    Raises:
        WriteError: ``path`` names no file (``""``, ``.``, ``..``).
        OSError: the file cannot be written or renamed into place (``path`` is then untouched).
    """
    target = _target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with writers_lock(target.parent) as exclusive:
        if exclusive:
            _delete_temporaries(target.parent, target.name)
        tmp = target.with_name(_temp_name(target.name))
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600))
        try:
            yield tmp
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, _final_mode(target))
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with contextlib.suppress(OSError):  # not supported on every platform / filesystem
            fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically; see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding))
