"""Progress a person can follow during ``memtoc run``.

The notebooks run in a kernel process; ``memtoc run`` sets ``$MEMTOC_PROGRESS_FILE`` for it. The
generation code (``backends.base.Generator.generate``) writes its state there after every batch
(``report``); a :class:`Watcher` thread in ``memtoc run`` reads it and prints a line such as

    [2/6] 02_elicitation: smollm2 forced: 96/450 replies, 3.2/s, about 1 min 50 s left

when it changes (every ``interval`` s at most). Without the variable (a notebook opened in
Jupyter, a test) ``report`` does nothing.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

ENV = "MEMTOC_PROGRESS_FILE"
PROGRESS_NAME = ".progress.json"


def report(desc: str, done: int, total: int, started: float, unit: str = "replies") -> None:
    """Record ``done`` of ``total`` for the watcher (no-op unless ``$MEMTOC_PROGRESS_FILE`` is set)."""
    path = os.environ.get(ENV)
    if not path:
        return
    p = Path(path)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"desc": desc, "done": int(done), "total": int(total), "unit": unit,
                                   "started": started, "now": time.time()}))
        os.replace(tmp, p)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def format_state(d: dict) -> str:
    """``desc: done/total unit, rate/s, about T left``."""
    done, total = int(d.get("done", 0)), int(d.get("total", 0))
    el = max(float(d.get("now", 0)) - float(d.get("started", 0)), 1e-9)
    line = f"{d.get('desc') or 'generating'}: {done}/{total} {d.get('unit', 'replies')}"
    if done > 0:
        rate = done / el
        line += f", {rate:.2f}/s" if rate < 10 else f", {rate:.0f}/s"
        if total > done:
            line += f", about {_duration((total - done) / rate)} left"
    return line


class Watcher:
    """Polls the progress file in a daemon thread and echoes changed states."""

    def __init__(self, path: Path, echo: Callable[[str], None], prefix: str = "", interval: float = 10.0,
                 poll: float = 1.0):
        self.path, self.echo, self.prefix = Path(path), echo, prefix
        self.interval, self.poll = interval, poll
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last: Optional[str] = None
        self._last_t = time.monotonic()   # the first line comes after ``interval`` (or at a finish)

    def check(self) -> Optional[str]:
        """Echo the current state if it changed and ``interval`` passed (or it finished a stage)."""
        try:
            d = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        line = format_state(d)
        key = f"{d.get('desc')}|{d.get('done')}"
        now = time.monotonic()
        final = d.get("done") == d.get("total")
        if key != self._last and (final or now - self._last_t >= self.interval):
            self._last, self._last_t = key, now
            self.echo(self.prefix + line)
            return line
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            self.check()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.check()
