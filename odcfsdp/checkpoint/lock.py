"""One run at a time in a directory: the lock a training run holds on its ``run.out_dir`` (and ``checkpoint.dir``).

Design note [run-lock]
----------------------
Two runs started into one directory both ran: their ``metrics.jsonl`` lines interleaved, and one run's saves moved
the other's checkpoints aside (issue 44). A directory now holds one run at a time, also when two start at once. A run
locks its ``run.out_dir`` and its checkpoint directory (wherever it is, inside ``run.out_dir`` too: another run's
``checkpoint.dir`` may point there):

1. the lock is ``fcntl.flock`` on ``<dir>/run.lock``, asked for without waiting: of any number of processes that
   ask at the same instant exactly one gets it (the kernel decides), and the others are refused in one line naming
   the holder, read from the file: its pid, host and start time, which the holder writes once it holds the lock;
2. the kernel lets go of the lock when its holder ends, however it ends (SIGKILL included). A lock file whose lock
   is free is stale: it is taken over, with a note naming the run that left it, unless the file names a process of
   this host that is still alive (the same pid and start time: a reused pid is not), which is refused as in 1 (a
   file system that lost its locks must not let a second run in);
3. the holder releases it by removing the file, then closing it. A process that opened the file before it was
   removed and got the lock after checks that the file it holds is still the one at the path (same inode) and
   tries again otherwise: two processes never hold locks on two files of one path;
4. the file is opened close-on-exec: the helpers and ranks the holder starts do not keep it locked after it ends.
   ``exit_now`` (a second signal after the ranks stopped) releases it too (``before_exit_now``);
5. a file system without locks (ENOLCK, EOPNOTSUPP) runs unlocked, with a note saying so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..interrupts import before_exit_now

LOCK_FILE = "run.lock"
#: errors of a file system that has no locks ([run-lock] 5)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
#: seconds to wait for a holder that has its lock but has not written its record yet (a moment: [run-lock] 1)
RECORD_WAIT_S = 2.0


class InUseError(ValueError):
    """The directory's lock is held by another run ([run-lock]); the message names the run and the fix."""


def _started_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (Linux ``/proc``): with the pid, it names one process
    (a pid is reused, a pid and its start time are not); None where it cannot tell."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(record: dict) -> bool:
    """Whether the process ``record`` names is alive: on this host, the same pid and start time ([run-lock] 2)."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    ticks = _started_ticks(pid)
    if ticks is not None:
        return ticks == record.get("ticks")
    if Path("/proc/self/stat").exists():  # /proc, and no such process
        return False
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read(fd: int) -> dict | None:
    """The holder's record in the open lock file (None: empty or torn)."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        record = json.loads(text) if text.strip() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the file at ``path`` ([run-lock] 3)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def describe(record: dict | None) -> str:
    """``run pid N (started T)`` for a holder's record, with its host where that is not this one."""
    if not record:
        return "another run (starting: its pid is not written yet)"
    host = record.get("host")
    where = f" on host {host}" if host and host != socket.gethostname() else ""
    return f"run pid {record.get('pid')} (started {record.get('started', '?')}{where})"


class DirLock:
    """``directory``'s run lock ([run-lock]), held from ``acquire`` to ``release`` (a context manager). ``key`` is
    the config key that named the directory, for the messages; ``note`` is the one line to print after ``acquire``
    (a stale lock taken over, or no locks on this file system), else None."""

    def __init__(self, directory: str | Path, key: str = "run.out_dir"):
        self.directory, self.key = Path(directory), key
        self.path = self.directory / LOCK_FILE
        self.note: str | None = None
        self._fd: int | None = None

    def _refusal(self, record: dict | None) -> InUseError:
        return InUseError(f"{self.key}={str(self.directory)!r} is in use by {describe(record)}: wait for it to end "
                          f"(or stop it), or choose another {self.key}")

    def _holder(self, fd: int) -> dict | None:
        """The record of the run that holds the lock, waiting a moment for one that has not written it yet."""
        deadline = time.monotonic() + RECORD_WAIT_S
        while (record := _read(fd)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return record

    def acquire(self) -> "DirLock":
        """Take the lock or raise ``InUseError`` naming its holder; returns self."""
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = self._holder(fd)
                os.close(fd)
                raise self._refusal(record) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in NO_LOCKS:
                    raise
                self.note = (f"note: {self.key}={str(self.directory)!r} is on a file system without locks "
                             f"({e.strerror}): two runs started there at once are not kept apart")
                return self
            if _same_file(fd, self.path):
                break
            os.close(fd)  # released (and removed) between our open and our lock: [run-lock] 3
        previous = _read(fd)
        if previous and _alive(previous):
            os.close(fd)
            raise self._refusal(previous)
        if previous:
            self.note = (f"note: {self.key}={str(self.directory)!r}: {describe(previous)} ended without releasing "
                         "its lock (killed?); taken over")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "ticks": _started_ticks(os.getpid())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        before_exit_now(self.release)
        return self

    def release(self) -> None:
        """Give the lock back: remove the file, then close it ([run-lock] 3). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        before_exit_now(self.release, add=False)
        try:
            if _same_file(fd, self.path):
                self.path.unlink()
        except OSError:  # the directory went away: nothing is left to release but the lock itself
            pass
        finally:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["DirLock", "InUseError", "LOCK_FILE", "describe"]
