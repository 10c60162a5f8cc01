"""memtoc.core.io: the one copy of the JSON / atomic-write / hashing helpers."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from memtoc.core import io


def test_plain_makes_json_safe_values():
    obj = {1: np.int64(3), "f": np.float32(0.5), "nan": float("nan"), "b": np.bool_(True), "t": (1, 2),
           "a": np.array([1.5, np.nan]), "p": Path("/x/y"), "na": pd.NA, "s": "é"}
    out = io.plain(obj)
    assert out == {"1": 3, "f": 0.5, "nan": None, "b": True, "t": [1, 2], "a": [1.5, None], "p": "/x/y",
                   "na": None, "s": "é"}
    assert type(out["1"]) is int and type(out["b"]) is bool
    json.dumps(out, allow_nan=False)


def test_write_json_and_jsonl_formats(tmp_path):
    p = io.write_json(tmp_path / "a" / "s.json", {"x": np.float64(1.0), "é": [1]}, indent=1, newline=False)
    assert p.read_text(encoding="utf-8") == json.dumps({"x": 1.0, "é": [1]}, indent=1, ensure_ascii=False)
    q = io.write_json(tmp_path / "t.json", {"x": 1})
    assert q.read_text().endswith("}\n")
    r = io.write_jsonl(tmp_path / "r.jsonl", [{"v": float("nan")}, {"v": "ü"}])
    assert r.read_text(encoding="utf-8") == '{"v": null}\n{"v": "ü"}\n'
    raw = io.write_jsonl(tmp_path / "raw.jsonl", [{"v": 1}], convert=False)
    assert raw.read_text() == '{"v": 1}\n'
    assert sorted(x.name for x in tmp_path.rglob("*.tmp")) == []


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    p = tmp_path / "f.txt"
    io.atomic_write_text(p, "old")
    with pytest.raises(TypeError):
        io.atomic_write_text(p, None)          # cannot be written: the old content stays
    assert p.read_text() == "old" and not list(tmp_path.glob("*.tmp"))


def test_hashes(tmp_path):
    assert io.sha256_text("é") == hashlib.sha256("é".encode()).hexdigest()
    assert io.sha256_json({"b": 1, "a": "é"}) == io.sha256_json({"a": "é", "b": 1})
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100_000)
    assert io.sha256_file(f, chunk=4096) == hashlib.sha256(b"x" * 100_000).hexdigest()


def test_json_lines_never_hold_a_character_other_readers_split_on():
    from memtoc.core.io import json_line, write_jsonl
    from memtoc.core.records import dumps
    row = {"reply": "one\u2028two\u2029three\x85four", "plain": "Zürich — ok"}
    line = json_line(row)
    assert len(line.splitlines()) == 1 and json.loads(line) == row and "Zürich — ok" in line
    assert dumps(row) == line


def test_transfer_score_output_is_one_line_per_record(tmp_path):
    from memtoc.core.errors import MemtocError
    from memtoc.core.jsonl import write_output
    out = tmp_path / "scored.jsonl"
    write_output([{"response": "A\u2028B"}, {"response": "C"}], out, MemtocError)
    text = out.read_text(encoding="utf-8")
    assert len(text.splitlines()) == 2 and [json.loads(l) for l in text.splitlines()][0]["response"] == "A\u2028B"
