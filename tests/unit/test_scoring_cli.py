"""`memtoc score IN.jsonl [-o OUT.jsonl] [--matcher paper|strict]` on a file with malformed lines."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memtoc.cli import main

GOOD = [
    {"id": "0.0", "question": "Which park does the example garden link to a zoo?",
     "response": "The tool says Moor Park.\nFINAL: Moor Park, Blackpool", "gold": "Stanley Park, Blackpool",
     "tool_value": "Moor Park, Blackpool", "memory": "Stanley Park"},
    {"id": "0.1", "response": "FINAL: UNKNOWN", "gold": "Thomas Mawson", "tool_value": None, "memory": ""},
    {"id": "x", "response": "FINAL: Paris", "gold": "Parish", "tool_value": "Parisville", "memory": None},
]


def _write(tmp_path, lines):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return p


def _lines_with_errors():
    return [json.dumps(GOOD[0]),
            "{not json",                                                     # line 2
            json.dumps({k: v for k, v in GOOD[1].items() if k != "gold"}),   # line 3: missing gold
            "",                                                              # blank lines are skipped
            json.dumps({**GOOD[1], "tool_value": 3}),                        # line 5: wrong type
            json.dumps(GOOD[1]),
            json.dumps([1, 2]),                                              # line 7: not an object
            json.dumps(GOOD[2])]


def test_score_cli_reports_malformed_lines_and_scores_the_rest(tmp_path, capsys):
    src = _write(tmp_path, _lines_with_errors())
    out = tmp_path / "sub" / "out.jsonl"
    rc = main(["score", str(src), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{src}:2: not valid JSON" in err
    assert f"{src}:3: missing field 'gold'" in err
    assert f"{src}:5: field 'tool_value' must be str or null, got int" in err
    assert f"{src}:7: expected a JSON object" in err
    assert "3 scored, 4 malformed, matcher=paper" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["0.0", "0.1", "x"]
    assert rows[0]["question"] == GOOD[0]["question"]                       # input fields kept
    assert (rows[0]["extracted"], rows[0]["outcome"], rows[0]["final_correct"]) == ("Moor Park, Blackpool", "followed_tool", False)
    assert (rows[1]["outcome"], rows[1]["neither_subtype"], rows[1]["abstain"]) == ("neither", "abstain", True)
    assert rows[2]["final_correct"] is True and rows[2]["outcome"] == "followed_tool"
    for r in rows:
        assert set(r) >= {"extracted", "followed_tool", "kept_memory", "final_correct", "abstain",
                          "outcome", "neither_subtype"}


def test_score_cli_stdout_and_strict(tmp_path, capsys):
    src = _write(tmp_path, [json.dumps(g) for g in GOOD])
    rc = main(["score", str(src), "--matcher", "strict"])
    cap = capsys.readouterr()
    assert rc == 0
    rows = [json.loads(line) for line in cap.out.splitlines()]
    assert len(rows) == 3 and rows[2]["final_correct"] is False and rows[2]["outcome"] == "neither"
    assert "matcher=strict" in cap.err and "0 malformed" in cap.err


def test_score_cli_missing_file_is_a_one_line_error(tmp_path, capsys):
    rc = main(["score", str(tmp_path / "nope.jsonl")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_score_cli_help_mentions_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["score", "--help"])
    assert "exit status" in capsys.readouterr().out.lower()


def test_score_cli_as_a_process(tmp_path):
    src = _write(tmp_path, _lines_with_errors())
    p = subprocess.run([sys.executable, "-m", "memtoc", "score", str(src)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1
    assert len(p.stdout.splitlines()) == 3 and p.stderr.count("malformed line") == 4
