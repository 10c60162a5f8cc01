"""JSONL input and output of the offline scoring commands (``memtoc score``, ``memtoc transfer score``):
reading the input (a file or stdin), reporting malformed lines by file and line, refusing to score
in place, writing the output atomically."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from memtoc.core.errors import MemtocError
from memtoc.core.io import atomic_write_text, json_line


def split_lines(text: str) -> list[str]:
    """JSONL lines of ``text``: they end at "\n" only (a trailing "\r" is dropped); str.splitlines()
    would also split inside replies that contain U+2028, U+0085 and other Unicode line breaks
    (json.dumps keeps them unescaped)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def read_lines(path: Path, error: type[MemtocError], missing: str = "", note: str = "") -> list[str]:
    """The JSONL lines of the file ``path``; ``error`` when it is missing (message ``missing``, default
    "input file <path> does not exist") or not UTF-8 (the message ends with ``note``)."""
    if not path.is_file():
        raise error(missing or f"input file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e}){note}") from None
    return split_lines(text)


def json_lines(lines: Iterable[str]) -> Iterator[tuple[int, Any, Optional[str]]]:
    """``(line number, object, None)`` for every non-blank line, ``(line number, None, "not valid JSON
    (... at column n)")`` for one that does not parse."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line), None
        except json.JSONDecodeError as e:
            yield lineno, None, f"not valid JSON ({e.msg} at column {e.colno})"


def read_input(input_path: str, output: Optional[Path], error: type[MemtocError], prog: str) -> tuple[list[str], str]:
    """(lines, source name) of ``input_path`` ('-': stdin). Raises ``error`` when the output is a
    folder or the input file itself (scoring in place would lose the malformed lines), or when the
    input is missing or not UTF-8. Lines: :func:`split_lines`."""
    if output is not None and output.is_dir():
        raise error(f"-o {output}: is a directory; give a file path, e.g. -o {output / 'scored.jsonl'}")
    if input_path == "-":
        return split_lines(sys.stdin.read()), "<stdin>"
    path = Path(input_path)
    if output is not None and output.exists() and path.exists() and output.resolve() == path.resolve():
        raise error(f"-o {output}: is the input file; scoring in place would overwrite the input "
                    "(malformed lines would be lost); write to another file")
    return read_lines(path, error, note=f"; {prog} reads JSONL"), str(path)


def parse_records(lines: Iterable[str], source: str, check: Callable[[Any], Optional[str]], sep: str = " ",
                  json_field: str = "") -> tuple[list[dict[str, Any]], list[str]]:
    """(the objects of the non-blank lines that ``check`` accepts, errors). ``check`` returns None or
    what is wrong; an error reads ``source:line:<sep><problem>``, a line that is not JSON
    ``source:line:<json_field> not valid JSON (...)``."""
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    for lineno, obj, bad in json_lines(lines):
        if bad:
            errors.append(f"{source}:{lineno}:{json_field} {bad}")
            continue
        problem = check(obj)
        if problem:
            errors.append(f"{source}:{lineno}:{sep}{problem}")
            continue
        out.append(obj)
    return out, errors


def write_output(records: Iterable[dict[str, Any]], output: Optional[Path], error: type[MemtocError]) -> None:
    """JSONL to ``output`` (atomically; ``error`` when it cannot be written), or stdout when None."""
    payload = "".join(json_line(r) + "\n" for r in records)
    if output is None:
        sys.stdout.write(payload)
        return
    try:
        atomic_write_text(output, payload)
    except OSError as e:
        raise error(f"-o {output}: cannot write ({e.strerror or e})") from None
