"""A run's raw replies as a dataset: ``memtoc export RUN_DIR OUT``.

Writes, from ``scored/<model>/`` of a finished run (notebooks 02 and 03):

* ``episodes.parquet``: one row per scored with-tool episode (every model, arm, frame and formulation):
  the episode's identity (the prompt as its sha256, not its text), the reply, the extracted span, the
  decision and the source-correctness cell;
* ``closed_book.parquet``: one row per closed-book reply (the model's memory, per formulation and
  variant);
* ``README.md``: a dataset card (Hugging Face's front matter with both configurations, what each column
  is, the run's commit, models and parameters, the release's licence);
* ``SHA256SUMS``: the checksum of each file, in ``sha256sum -c`` format.

Read it back with ``datasets.load_dataset("parquet", data_files=...)`` or ``pandas.read_parquet``; the
headline metrics recomputed from ``episodes.parquet`` (``memtoc.stages.evaluation.analyses.headline``)
are the run's summary numbers (tests/unit/test_export.py).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import DataError
from memtoc.core.io import atomic_write_text, sha256_file, sha256_text

#: what each exported column holds; a column without a line here is refused (the card names every column)
EPISODE_COLUMNS: dict[str, str] = {
    "model": "the model's label in the run (an adapter: `<model>__<objective>__fold<k>`)",
    "episode_id": "the episode's id: question, condition, formulation, frame and arm",
    "question_id": "the question's id in the MemToC release",
    "qkey": "the question's key (the release's `qkey`)",
    "instance_id": "the ToolHop instance the question comes from",
    "formulation": "reference | paraphrase_a | paraphrase_b: the question's wording",
    "condition": "tool_right | tool_wrong | tool_far | tool_error | no_tool | noop: what the tool returned",
    "frame": "schema | no_schema | passage: how the return was shown",
    "arm": "untreated | warn | prior | flag | no_protocol_sentence: the prompt's mitigation arm",
    "payload_kind": "the error payload's kind for tool_error (else null)",
    "tool_value": "the factual value in the tool return (null: error, no tool, no-op)",
    "tool_correct": "true: the return is the verified answer; false: a distractor or an error; null: none",
    "tool_output": "the tool return shown to the model (JSON text)",
    "schema": "the tool's schema shown to the model (JSON text; null without one)",
    "schema_kind": "toolhop | synthesized | none: where the schema comes from",
    "prompt_sha256": "sha256 of the single user-turn prompt (its text is rebuilt by `memtoc.core.prompts`)",
    "question": "the question text (MemToC release, Apache-2.0)",
    "gold": "the verified answer g",
    "gold_kind": "the answer's kind (entity, date, number, ...), which selects the matcher's rules",
    "fold": "the question's cross-fitting fold (chain-level), null outside the folds",
    "response": "the model's reply y, as generated (cut after its first completed FINAL line)",
    "extracted": "the answer extracted from the reply's FINAL line",
    "followed_tool": "the extracted answer matches the tool value",
    "kept_memory": "the extracted answer matches the closed-book answer m",
    "final_correct": "the extracted answer matches the verified answer g",
    "abstain": "the reply abstains",
    "outcome": "followed_tool | kept_memory | both | neither",
    "neither_subtype": "for neither: abstain or other (else null)",
    "memory_span": "the closed-book answer m the reply is compared with (same formulation)",
    "mem_absent": "the model had no closed-book answer (abstained or no FINAL line)",
    "memory_correct": "m matches g (null when m is absent)",
    "cell": "the source-correctness cell from m, r and g (both_right, arb, mem_only, tool_only, ...)",
    "matcher": "paper | strict: the matcher that scored the row",
    "n_new_tokens": "new tokens of the reply",
    "cached": "the reply was read from the run's cache rather than generated in that session",
}
CLOSED_BOOK_COLUMNS: dict[str, str] = {
    "model": EPISODE_COLUMNS["model"],
    "formulation": EPISODE_COLUMNS["formulation"],
    "variant": "forced | permissive: the closed-book instruction (forced is the memory m)",
    "question_id": EPISODE_COLUMNS["question_id"],
    "qkey": EPISODE_COLUMNS["qkey"],
    "instance_id": EPISODE_COLUMNS["instance_id"],
    "response": "the model's closed-book reply",
    "span": "the answer extracted from it (the memory m)",
    "mem_absent": EPISODE_COLUMNS["mem_absent"],
    "memory_correct": EPISODE_COLUMNS["memory_correct"],
    "gold": EPISODE_COLUMNS["gold"],
    "gold_kind": EPISODE_COLUMNS["gold_kind"],
    "fold": EPISODE_COLUMNS["fold"],
    "n_new_tokens": EPISODE_COLUMNS["n_new_tokens"],
    "cached": EPISODE_COLUMNS["cached"],
}
#: nested values stored as JSON text (a stable parquet type whatever their shape)
JSON_COLUMNS = ("tool_output", "schema")
FILES = ("episodes.parquet", "closed_book.parquet", "README.md")


class ExportError(DataError):
    """A run cannot be exported as it is (nothing scored, an undocumented column)."""


def _read_jsonl_frames(paths: Sequence[Path]) -> pd.DataFrame:
    frames = [pd.read_json(p, lines=True, dtype=False) for p in paths if p.stat().st_size]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _checked(df: pd.DataFrame, docs: dict[str, str], what: str) -> pd.DataFrame:
    unknown = [c for c in df.columns if c not in docs]
    if unknown:
        raise ExportError(f"{what}: column(s) {', '.join(unknown)} have no description in memtoc.run.export "
                          f"({'EPISODE_COLUMNS' if what == 'episodes' else 'CLOSED_BOOK_COLUMNS'}); add one so "
                          "that the dataset card names every column")
    return df[[c for c in docs if c in df.columns]]


def episode_table(run_dir: Path) -> pd.DataFrame:
    """Every scored with-tool episode of the run (``scored/<model>/*.jsonl`` without the closed-book files)."""
    paths = RunPaths(run_dir)
    files = sorted(p for p in paths.scored_dir("scored").glob("*/*.jsonl") if not p.name.startswith("closed_book_"))
    df = _read_jsonl_frames(files)
    if df.empty:
        raise ExportError(f"{paths.scored_dir('scored')}: no scored episodes; run notebook 03_evaluation first")
    df = df.copy()
    df["prompt_sha256"] = df.pop("prompt").map(lambda t: sha256_text(t) if isinstance(t, str) else None) if "prompt" in df else None
    for c in JSON_COLUMNS:
        if c in df:
            df[c] = df[c].map(lambda v: None if v is None or (isinstance(v, float) and pd.isna(v))
                              else json.dumps(v, sort_keys=True, ensure_ascii=False))
    return _checked(df, EPISODE_COLUMNS, "episodes")


def closed_book_table(run_dir: Path) -> pd.DataFrame:
    """Every closed-book reply of the run (``scored/<model>/closed_book_<variant>.jsonl``)."""
    paths = RunPaths(run_dir)
    df = _read_jsonl_frames(sorted(paths.scored_dir("scored").glob("*/closed_book_*.jsonl")))
    if df.empty:
        raise ExportError(f"{paths.scored_dir('scored')}: no closed-book replies; run notebook 02_elicitation first")
    return _checked(df, CLOSED_BOOK_COLUMNS, "closed_book")


def _card(run_dir: Path, episodes: pd.DataFrame, closed: pd.DataFrame) -> str:
    config_json = RunPaths(run_dir).config_json
    cfg = json.loads(config_json.read_text(encoding="utf-8")) if config_json.is_file() else {}
    prov = cfg.get("provenance") or {}
    params = cfg.get("params") or {}
    keep = ("run_name", "models", "backend", "dtype", "max_new_tokens", "formulations", "n_questions",
            "n_questions_extra", "extra_arms", "matcher", "seed")
    lines = ["---", "license: apache-2.0", "pretty_name: MemToC run replies", "configs:",
             "- config_name: episodes", "  data_files: episodes.parquet",
             "- config_name: closed_book", "  data_files: closed_book.parquet", "---", "",
             f"# MemToC replies of the run `{params.get('run_name') or run_dir.name}`", "",
             "Raw replies of a memtoc run (https://arxiv.org/abs/2608.26295, Varlamov et al.), scored by memtoc's "
             "extractor and matcher: each with-tool episode's decision and source-correctness cell, and the "
             "closed-book answers they are compared with. The questions, answers and tool returns come from the "
             "MemToC release (Apache-2.0; it builds on ToolHop, Apache-2.0, and Wikidata, CC0).", "",
             f"- memtoc commit: `{(prov.get('git') or {}).get('commit') or 'unknown'}`",
             f"- models: {', '.join(sorted(episodes['model'].unique()))}",
             f"- episodes: {len(episodes):,}; closed-book replies: {len(closed):,}", "",
             "Parameters:", "", "```json",
             json.dumps({k: params[k] for k in keep if k in params}, indent=1, default=str), "```", "",
             "```python", "from datasets import load_dataset",
             "episodes = load_dataset(\"parquet\", data_files=\"episodes.parquet\")[\"train\"]", "```", ""]
    for name, docs, df in (("episodes", EPISODE_COLUMNS, episodes), ("closed_book", CLOSED_BOOK_COLUMNS, closed)):
        lines += [f"## `{name}` columns", "", "| column | type | what it is |", "|---|---|---|"]
        lines += [f"| `{c}` | {df[c].dtype} | {docs[c]} |" for c in df.columns]
        lines.append("")
    lines += ["`SHA256SUMS` holds each file's checksum (`sha256sum -c SHA256SUMS`)."]
    return "\n".join(lines) + "\n"


def export_run(run_dir, out) -> dict[str, Any]:
    """Write the run's episodes, closed-book replies, a dataset card and checksums into ``out``;
    returns ``{file: sha256}``."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    episodes, closed = episode_table(run_dir), closed_book_table(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    episodes.to_parquet(out / "episodes.parquet", index=False)
    closed.to_parquet(out / "closed_book.parquet", index=False)
    atomic_write_text(out / "README.md", _card(run_dir, episodes, closed))
    sums = {f: sha256_file(out / f) for f in FILES}
    atomic_write_text(out / "SHA256SUMS", "".join(f"{h}  {f}\n" for f, h in sums.items()))
    return sums


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (outputs/<run>)")
    ap.add_argument("out", help="the folder to write the dataset into")
    a = ap.parse_args(argv)
    sums = export_run(a.run_dir, a.out)
    for f in sums:
        print(f"wrote {Path(a.out) / f}")
    return 0
