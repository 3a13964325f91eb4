"""Atomic writes: every file loragen writes goes to a temporary name in the target folder first.

A crash or an exception at any point leaves either the old content or the new one in place, never a
half-written file. Folders (an adapter, a sharded checkpoint) are built in a temporary sibling folder and
swapped in with renames.

Modes: the temporary files ``tempfile`` makes are private (0600 / 0700); before the rename each gets the
mode a plain ``open()`` / ``mkdir()`` would have given it under the process umask, or, when it replaces
an existing file or folder, that one's mode (so rewriting a script in place keeps its executable bit).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_file", "atomic_dir"]


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
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on every platform / filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced, given its final mode (the
    replaced file's, else the umask's) and renamed onto ``path``.

    The caller writes the temporary file however it likes (``safetensors.torch.save_file`` takes a path).
    On an exception the temporary file is removed and ``path`` is untouched.
    """
    del mode  # the caller opens the file itself; kept for readability at call sites
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, _final_mode(target, is_dir=False))
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically; see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder atomically: yield an empty temporary folder beside ``path``, swap it in on success.

    The files written into it get the mode the same file had in the folder replaced, else the umask's
    (whatever mode their writer created them with), and the folder itself likewise.

    If ``path`` already exists it is replaced only after the new folder is complete: it is first renamed
    aside, the new folder renamed into place, then the old one deleted. On an exception the temporary
    folder is removed and ``path`` keeps its old content.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for child in tmp.iterdir():
        if child.is_file():
            with open(child, "rb") as fh:
                os.fsync(fh.fileno())
            # writers that create their files privately (safetensors writes 0600) do not decide the mode:
            # a file gets the mode the same file had in the replaced folder, else the umask's
            os.chmod(child, _final_mode(target / child.name, is_dir=False))
    os.chmod(tmp, _final_mode(target, is_dir=True))
    if target.exists():
        if not target.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{target} exists and is not a folder; refusing to replace it")
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        old.rmdir()
        os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(old, target)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    _fsync_dir(target.parent)
