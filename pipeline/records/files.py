"""Files that readers never see half-written, and a lock for read-modify-write updates.

Bottom layer: imports nothing from the project, so the engine, the stages and orchestration share it.

- ``atomic_write_text`` / ``atomic_write_bytes`` / ``atomic_write``: temp file in the same folder, fsync,
  ``os.replace``, fsync of the folder: a reader sees the old file or the new one, never a part.
- ``follow_umask``: a file a library created private (safetensors writes 0600) gets the mode ``open()`` gives
  every other file of the run: 0666 minus the umask, so colleagues and servers under another user can read
  what the run's umask lets them read.
- ``locked``: an exclusive POSIX record lock (``fcntl.lockf``) on a lock file. Record locks are what shared
  cluster filesystems honour across nodes (NFS through lockd/NLM or v4 locks, Lustre mounted with
  ``flock``: ``localflock`` only locks within one node, GPFS); ``flock(2)`` is not forwarded by every NFS
  client. A filesystem that refuses locks gets a warning and unlocked updates. The kernel drops the lock
  when the holder dies, so a killed command never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or a new file) to disk; a no-op where the filesystem refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: Path | str, write: Callable[[IO[Any]], Any], *, binary: bool = False, durable: bool = True
) -> None:
    """Call ``write(f)`` on a temp file next to ``path`` and rename it over ``path``.

    ``durable``: fsync the file and its folder (survives a machine crash); without it only atomic.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc/self/status; elsewhere set and put back)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: Path | str) -> None:
    """Give ``path`` the mode a file made by ``open()`` has: 0666 minus the umask."""
    os.chmod(path, 0o666 & ~umask())


def atomic_write_text(path: Path | str, text: str, *, durable: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (readers see the old or the new file)."""
    atomic_write(path, lambda f: f.write(text), durable=durable)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(data), binary=True)


# A filesystem mounted without lock support (NFS ``nolock``, no lockd) answers ENOLCK: warn once per path and
# go on unlocked rather than stop every command (the previous behaviour, without the lock).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_WARNED: set[str] = set()


def _warn_unlocked(path: str, e: OSError) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        print(
            f"warning: {path}: the filesystem refuses POSIX locks ({e.strerror}); ledger updates "
            "from concurrent commands are not serialised",
            file=sys.stderr,
        )


_HELD: dict[str, tuple[threading.RLock, list[int]]] = {}
_HELD_GUARD = threading.Lock()


def _forget_held() -> None:  # a forked child holds no POSIX lock, whatever its parent held
    global _HELD_GUARD
    _HELD.clear()
    _HELD_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_held)


@contextlib.contextmanager
def locked(lock_path: Path | str) -> Iterator[None]:
    """Hold an exclusive POSIX record lock on ``lock_path`` (created if missing) for the ``with`` block.

    Blocks until the lock is free. Re-entrant within a process (POSIX locks belong to the process, and
    unlocking an inner hold would drop the outer one): threads queue on an in-process lock and only the
    outermost hold takes and releases the file lock.
    """
    key = os.path.abspath(lock_path)
    with _HELD_GUARD:
        mutex, state = _HELD.setdefault(key, (threading.RLock(), [0, -1]))
    with mutex:
        if state[0] == 0:
            Path(key).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o666)  # mode: the umask decides
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_LOCKS:
                    raise
                _warn_unlocked(key, e)
                fd = -1
            except BaseException:
                os.close(fd)
                raise
            state[1] = fd
        state[0] += 1
        try:
            yield
        finally:
            state[0] -= 1
            if state[0] == 0 and state[1] >= 0:
                fd, state[1] = state[1], -1
                try:
                    fcntl.lockf(fd, fcntl.LOCK_UN)
                finally:
                    os.close(fd)


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    """Streamed sha256 of a file's content (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
