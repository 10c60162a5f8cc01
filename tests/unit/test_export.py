"""`memtoc export RUN_DIR OUT`: a run's scored replies as Parquet with a dataset card. The round trip is
checked on a run whose stages ran through their own code with scripted models (test_claims_pipeline's
``stage_run``): the headline metrics recomputed from the exported file are the summary's numbers."""
from __future__ import annotations

import hashlib
import json
import re

import pandas as pd
import pytest
from test_claims_pipeline import MODELS, stage_run  # noqa: F401  (fixture)

from memtoc.cli import main as cli_main
from memtoc.config.params import DEFAULTS
from memtoc.core.io import plain
from memtoc.run import export as X
from memtoc.stages.evaluation.analyses.headline import headline_metrics


@pytest.fixture(scope="module")
def exported(stage_run, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("export") / "ds"
    assert cli_main(["export", str(stage_run), str(out)]) == 0
    return out


def test_headline_metrics_recomputed_from_the_export_equal_the_summary(stage_run, exported):  # noqa: F811
    summary = json.loads((stage_run / "summaries" / "evaluation.json").read_text())
    df = pd.read_parquet(exported / "episodes.parquet")
    assert set(df["model"]) == set(MODELS) and "prompt" not in df and df["prompt_sha256"].str.len().eq(64).all()
    for m in MODELS:
        got = headline_metrics(df[df["model"] == m], DEFAULTS["formulations"], n_boot=summary["n_boot"],
                               seed=summary["seed"], alpha=summary["alpha"])
        assert json.loads(json.dumps(plain(got))) == summary["models"][m]["headline"], m
    closed = pd.read_parquet(exported / "closed_book.parquet")
    assert set(closed["variant"]) == {"forced", "permissive"} and set(closed["model"]) == set(MODELS)


def test_the_card_names_every_column_and_the_checksums_hold(exported):
    card = (exported / "README.md").read_text()
    for name in ("episodes", "closed_book"):
        cols = pd.read_parquet(exported / f"{name}.parquet").columns
        section = card.split(f"## `{name}` columns")[1].split("\n## ")[0]
        assert [c for c in cols if f"| `{c}` |" not in section] == []
    assert re.search(r"^configs:\n- config_name: episodes\n  data_files: episodes.parquet", card, re.M)
    for line in (exported / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((exported / name).read_bytes()).hexdigest() == digest


def test_datasets_reads_the_export(exported):
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_files=str(exported / "episodes.parquet"), split="train",
                               cache_dir=str(exported.parent / "hf-cache"))
    assert len(ds) == len(pd.read_parquet(exported / "episodes.parquet")) and "cell" in ds.column_names


def test_an_undocumented_column_and_an_empty_run_are_refused(stage_run, tmp_path, monkeypatch):  # noqa: F811
    with pytest.raises(X.ExportError, match="no scored episodes"):
        X.export_run(tmp_path, tmp_path / "out")
    monkeypatch.delitem(X.EPISODE_COLUMNS, "cell")
    with pytest.raises(X.ExportError, match="cell have no description.*EPISODE_COLUMNS"):
        X.export_run(stage_run, tmp_path / "out2")
