"""The paper's printed numbers, as repository files under ``paper/published/`` (see its README.md).

Facts of the paper, not of the release: Table 1, Table 4, the numbers printed in the text
(``prose.json``: §5.2-§5.4, the distractor-distance and protocol-sentence results) and the
probe / agent / transfer / scale tables (``probes_agent_transfer.json``: Tables 6-8, App. C, F).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from memtoc.core.project import REPO_ROOT
from memtoc.stages.report.published.result import PublishedCheckError

PUBLISHED_DIR = REPO_ROOT / "paper" / "published"
FILES = ("table1", "table4", "prose", "probes_agent_transfer")


@lru_cache(maxsize=None)
def _read(path: Path) -> Any:
    if not path.is_file():
        raise PublishedCheckError(f"{path} does not exist; paper/published/ holds the paper's printed numbers "
                                  "(restore it from the repository)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PublishedCheckError(f"{path}: not valid JSON ({e}); fix the file") from e


def printed(name: str, directory: Path | str | None = None) -> Any:
    """``paper/published/<name>.json`` (``name`` one of :data:`FILES`)."""
    if name not in FILES:
        raise PublishedCheckError(f"unknown printed-number file {name!r}; one of {', '.join(FILES)}")
    return _read((Path(directory) if directory else PUBLISHED_DIR) / f"{name}.json")


def prose_value(prose: dict, section: str, key: str) -> Any:
    """The printed value of ``prose.json`` ``<section>.<key>`` (an entry ``{value, where, what}``)."""
    try:
        entry = prose[section][key]
        return entry["value"]
    except (KeyError, TypeError) as e:
        raise PublishedCheckError(f"paper/published/prose.json: {section}.{key}.value is missing; add the "
                                  "printed number with its 'where' and 'what'") from e


def where(prose: dict, section: str, key: str) -> str:
    entry = prose.get(section, {}).get(key, {})
    return f"paper {entry.get('where', section)} (paper/published/prose.json {section}.{key})"
