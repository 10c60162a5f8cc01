"""Agent traces: one JSONL file per model (``agent/<model>/traces.jsonl``), one event per line.

Every event carries ``event`` (start | request | response | decision | validation | execution |
termination), ``episode`` (the episode key: sha256 of everything the episode depends on, see
``protocols.EpisodeSpec.key``), ``episode_id``, ``turn`` and ``attempt`` (the invocation that wrote
it). Requests carry ``messages_sha256`` (canonical JSON of the message list), ``tools_sha256`` and the
sha256 of the last message; responses the rendered prompt's sha256 (in-process) or the request
body's (server); executions the sha256 of the tool content. The ``termination`` event carries the
episode's scored record (what the metrics read).

Resume: events are appended round by round (write + flush + fsync, ``cache.append_records``). On
open, the episodes with a ``termination`` event are finished and never run again; the events of
episodes a kill interrupted (and a torn last line) are dropped by rewriting the file atomically
(temp file + rename), so a resumed run appends a clean, complete history for them.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from memtoc.core.jsonl import split_lines
from memtoc.generation import cache as _cache

EVENTS = ("start", "request", "response", "decision", "validation", "execution", "termination")


def messages_sha256(messages: Any) -> str:
    return _cache.sha256_text(_cache.canonical_json(messages))


class Trace:
    """The event log of one model's episodes (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.attempt = uuid.uuid4().hex[:12]
        self.resume_info: dict[str, Any] = {"finished": 0, "dropped_events": 0, "dropped_episodes": 0,
                                            "torn_lines": 0}
        self._finished: Optional[dict[str, dict]] = None

    def read_events(self) -> tuple[list[dict], int]:
        """(events of the complete lines, lines that did not parse)."""
        if not self.path.is_file():
            return [], 0
        events, bad = [], 0
        for line in split_lines(self.path.read_text(encoding="utf-8")):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(ev, dict) and ev.get("event") in EVENTS and isinstance(ev.get("episode"), str):
                events.append(ev)
            else:
                bad += 1
        return events, bad

    def open(self) -> dict[str, dict]:
        """Finished episodes (key -> termination event); drops the events of unfinished ones."""
        events, bad = self.read_events()
        done = {e["episode"]: e for e in events if e["event"] == "termination"}
        keep = [e for e in events if e["episode"] in done]
        dropped = len(events) - len(keep)
        if dropped or bad:
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    for e in keep:
                        f.write(json.dumps(e, ensure_ascii=False) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
        self.resume_info = {"finished": len(done), "dropped_events": dropped,
                            "dropped_episodes": len({e["episode"] for e in events} - set(done)), "torn_lines": bad}
        self._finished = done
        return done

    def append(self, events: Iterable[dict]) -> None:
        evs = []
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for e in events:
            e = dict(e)
            e.setdefault("attempt", self.attempt)
            e.setdefault("time", now)
            evs.append(e)
        _cache.append_records(self.path, evs)

    def terminations(self) -> list[dict]:
        events, _ = self.read_events()
        return [e for e in events if e["event"] == "termination"]

    def episode_events(self, episode_key: str) -> list[dict]:
        events, _ = self.read_events()
        return [e for e in events if e["episode"] == episode_key]
