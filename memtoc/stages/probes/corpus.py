"""The offline generic-text corpus the probes fit on (the Jacobian lens, the SAE's generic share)
and hold out on (lens quality, spliced loss).

``builtin`` is the text of Python's own reference documentation shipped with the interpreter
(``pydoc_data.topics``: English prose about the language, ~1 MB, no download). It is generic English
only in a loose sense (technical, code-heavy in places); the published lenses were fitted on
wikitext. A user file (``probes.corpus: path/to/text.txt``, UTF-8, documents separated by blank
lines) replaces it. Every output records which corpus was used (:class:`CorpusInfo`).
"""
from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from pydoc_data import topics
from typing import Any

from memtoc.core.errors import ConfigError
from memtoc.core.vocab import BUILTIN

BUILTIN_NAME = "python-pydoc_data-topics"


@dataclass(frozen=True)
class CorpusInfo:
    name: str            # builtin name or the file's path
    source: str          # builtin | file
    sha256: str          # of the documents joined by blank lines
    n_documents: int
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clean(doc: str) -> str:
    return re.sub(r"[ \t]+", " ", doc).strip()


def load_corpus(spec: str = BUILTIN, min_chars: int = 200) -> tuple[list[str], CorpusInfo]:
    """(documents, info) of ``builtin`` or a text file; documents shorter than ``min_chars`` are
    dropped, order is fixed (the file's, or the sorted topic names)."""
    if spec == BUILTIN:
        docs = [_clean(topics.topics[k]) for k in sorted(topics.topics)]
        name, source = BUILTIN_NAME, BUILTIN
        note = (f"Python {sys.version_info.major}.{sys.version_info.minor} reference documentation text "
                "(pydoc_data.topics, shipped with the interpreter): offline, technical English; the "
                "published lenses were fitted on wikitext")
    else:
        p = Path(spec).expanduser()
        if not p.is_file():
            raise ConfigError(f"probes.corpus: {spec!r} is neither 'builtin' nor an existing text file; give "
                              "a UTF-8 file with documents separated by blank lines, or 'builtin'")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"probes.corpus: {p} is not UTF-8 text ({e})") from None
        docs = [_clean(d) for d in re.split(r"\n\s*\n", text)]
        name, source, note = str(p.resolve()), "file", "user-supplied text file"
    docs = [d for d in docs if len(d) >= min_chars]
    if not docs:
        raise ConfigError(f"probes.corpus: {spec!r} has no document of at least {min_chars} characters")
    sha = hashlib.sha256("\n\n".join(docs).encode("utf-8")).hexdigest()
    return docs, CorpusInfo(name, source, sha, len(docs), note)


def split_corpus(docs: list[str], n_fit: int, n_heldout: int) -> tuple[list[str], list[str]]:
    """Disjoint fit and held-out documents: fit = every other document from the start, held-out =
    every other from the second (so both span the corpus)."""
    fit = docs[0::2][:n_fit]
    held = docs[1::2][:n_heldout]
    if len(fit) < n_fit or len(held) < n_heldout:
        raise ConfigError(f"probes: the corpus has {len(docs)} documents; {n_fit} fit + {n_heldout} held-out "
                          "were asked for (lower probes.lens_fit_prompts / probes.heldout_texts)")
    return fit, held
