"""One run at a time per run directory: an advisory lock file ``<run_dir>/.memtoc.lock``.

The holder keeps the file open with an exclusive ``flock`` and writes who it is into it (pid, host,
start time, command). The kernel drops a ``flock`` when its holder dies, even on SIGKILL, so:

* a second run finds the lock taken and stops with one line naming the holder;
* a lock file that still names a holder but is not locked was left by a killed run (stale): the
  next run takes it over with a warning;
* ``is_held`` tells a reader whether a run that ``config.json`` says is "running" is still alive.

The file is emptied (never deleted) on release, so no two processes can ever hold locks on two
different files of the same name.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from memtoc.config.runconfig import LOCK_NAME, RunPaths
from memtoc.core.errors import MemtocError


class RunLockedError(MemtocError):
    """Another live process holds the run directory."""


@dataclass(frozen=True)
class LockInfo:
    pid: int
    host: str
    started: str
    command: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"pid {self.pid} on host {self.host}, started {self.started}, command "
                f"{' '.join(self.command) or '?'}")

    @classmethod
    def here(cls, command: Optional[list[str]] = None) -> "LockInfo":
        return cls(pid=os.getpid(), host=platform.node(),
                   started=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   command=list(command if command is not None else [Path(sys.argv[0]).name, *sys.argv[1:]]))


def _parse(data: bytes) -> Optional[LockInfo]:
    try:
        d = json.loads(data.decode("utf-8"))
        return LockInfo(pid=int(d["pid"]), host=str(d["host"]), started=str(d["started"]),
                        command=[str(c) for c in d.get("command", [])])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def read_lock(run_dir: Path) -> Optional[LockInfo]:
    """Who the lock file names (None: no file, empty or unreadable)."""
    try:
        return _parse(RunPaths(run_dir).lock_file.read_bytes())
    except OSError:
        return None


def is_held(run_dir: Path) -> bool:
    """True while a live process holds the lock of ``run_dir`` (probes with a non-blocking flock)."""
    path = RunPaths(run_dir).lock_file
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may have taken
    return False


class RunLock:
    """``with RunLock(run_dir): ...`` or ``acquire()`` / ``release()``."""

    def __init__(self, run_dir: Path, command: Optional[list[str]] = None,
                 warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)):
        self.run_dir = Path(run_dir)
        self.path = RunPaths(self.run_dir).lock_file
        self.command = command
        self.warn = warn
        self.fd: Optional[int] = None
        self.info: Optional[LockInfo] = None
        self.took_over: Optional[LockInfo] = None   # the stale holder we replaced, if any

    def acquire(self) -> LockInfo:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_lock(self.run_dir)
            who = holder.describe() if holder else "another process (it has not written its name yet)"
            raise RunLockedError(f"run directory {self.run_dir} is in use by {who}; wait for that run to "
                                 "finish (or stop it), or use another run_name") from None
        old = os.pread(fd, 1 << 16, 0)
        stale = _parse(old) if old.strip() else None
        if old.strip():
            self.took_over = stale
            self.warn(f"memtoc: taking over a stale lock on {self.run_dir} ("
                      + (stale.describe() if stale else "unreadable lock file")
                      + "; that run ended without releasing it, e.g. it was killed)")
        self.info = LockInfo.here(self.command)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(self.info)).encode("utf-8") + b"\n", 0)
        os.fsync(fd)
        self.fd = fd
        return self.info

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # drops the flock
        self.fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
