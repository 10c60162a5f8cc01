"""`memtoc transfer import --hub` offline: a fixture folder in the Hub's layout
(DIR/<dataset name>/<config>/<split>.parquet), read through the real `datasets` library, exercises
the ARC join, each serialization-filter reason, the unanswerable rows, the sidecar and the CLI."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest

from memtoc import cli as memtoc_cli
from memtoc.stages.transfer import TransferDataError, hub, validate_file

L4 = ["A", "B", "C", "D"]


def _mc(rid, q, labels, texts, key, **extra):
    return {"id": rid, "question": q, "choices": {"label": labels, "text": texts}, "answerKey": key, **extra}


# ARC-Challenge: the world-true keys, spread over the three splits
ARC = {
    "train": [_mc("Mercury_1", "Which planet is closest to the Sun?", L4, ["Venus", "Mercury", "Mars", "Earth"], "B")],
    "validation": [_mc("Mercury_2", "How many legs does a spider have?", ["1", "2", "3", "4"],
                       ["8", "6", "10", "4"], "1")],
    "test": [
        _mc("Mercury_3", "Which gas do plants take in?", L4, ["carbon dioxide", "oxygen", "helium", "neon"], "A"),
        _mc("Mercury_4", "Which gas makes up most of the air?", L4, ["nitrogen", "oxygen", "argon", "neon"], "E"),
        _mc("Mercury_5", "What melts ice fastest?", L4, ["salt", "sand", "sugar", "flour"], "C"),
        _mc("Mercury_6", "What is frozen water?", L4, ["ice", "steam", "fog", "dew"], "A"),
        # labelled 1-4 in ARC, A-D in FaithEval: the key is carried over by option text
        _mc("Mercury_7", "Which is a mammal?", ["1", "2", "3", "4"], ["shark", "whale", "trout", "squid"], "2"),
        _mc("Mercury_8", "Which is a metal?", L4, ["iron", "Iron", "wood", "glass"], "A"),
    ],
}


def _cf(rid, arc_row, key, context, labels=None):
    return _mc(rid, arc_row["question"], labels or arc_row["choices"]["label"], arc_row["choices"]["text"], key,
               context=context, justification="", **{"num of options": 4})


_A = {r["id"]: r for rows in ARC.values() for r in rows}
FAITHEVAL_CF = [
    _cf("Mercury_1", _A["Mercury_1"], "C", "Mars is the planet closest to the Sun."),
    _cf("Mercury_2", _A["Mercury_2"], "2", "Spiders have six legs."),
    _cf("Mercury_3", _A["Mercury_3"], "B", "Plants take in oxygen to make sugar."),
    _cf("Mercury_4", _A["Mercury_4"], "B", "Air is mostly oxygen."),            # ARC key E: not among labels
    _cf("Mercury_5", _A["Mercury_5"], "C", "Sugar melts ice fastest."),          # same key as ARC
    _cf("Mercury_6", _A["Mercury_6"], "B", "   "),                              # empty passage
    _cf("Mercury_7", _A["Mercury_7"], "A", "Sharks are mammals.", labels=L4),
    _cf("Mercury_8", _A["Mercury_8"], "C", "Wood is a metal."),                  # options equal after normalising
    _cf("NoArc_9", _A["Mercury_1"], "A", "Venus is closest."),                   # id in no ARC split
]
FAITHEVAL_UN = [
    {"qid": "un-1", "question": "What is the name of Ada's brother?", "context": "Ada grew up by the sea.",
     "answers": ["unknown"], "subset": "SQuAD"},
    {"qid": "un-2", "question": "When did the library open?", "context": "", "answers": ["unknown"],
     "subset": "NewsQA"},
    {"qid": "un-1", "question": "Where was Ada born?", "context": "Ada liked boats.", "answers": ["unknown"],
     "subset": "SQuAD"},                                                       # id used twice
]


def write_fixture(root: Path, cf=FAITHEVAL_CF, un=FAITHEVAL_UN, arc=ARC) -> Path:
    """The three datasets as parquet files in the --from-dir layout, written by `datasets` itself."""
    tables = {(hub.COUNTERFACTUAL, "test"): cf, (hub.UNANSWERABLE, "test"): un}
    tables.update({(hub.ARC_CHALLENGE, s): rows for s, rows in arc.items()})
    for (src, split), rows in tables.items():
        path = src.local_path(root, split)
        path.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return root


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    src = write_fixture(tmp / "hubdir")
    out = tmp / "external.jsonl"
    counts = hub.import_hub(out, hub.dir_loader(src, str(tmp / "cache")), verified_ids=["Mercury_1"])
    return SimpleNamespace(out=out, counts=counts, src=src, tmp=tmp,
                           rows={r["id"]: r for r in map(json.loads, out.read_text().splitlines())})


def test_join_takes_gold_from_arc_and_cf_from_faitheval(imported):
    rows = imported.rows
    assert rows["Mercury_1"]["gold_key"] == "B" and rows["Mercury_1"]["cf_key"] == "C"
    assert rows["Mercury_2"]["gold_key"] == "1" and rows["Mercury_2"]["cf_key"] == "2"
    assert rows["Mercury_3"]["gold_key"] == "A" and rows["Mercury_3"]["cf_key"] == "B"
    # ARC labels 1-4 (key "2" = whale), FaithEval labels A-D: gold carried over by text
    assert rows["Mercury_7"]["gold_key"] == "B" and rows["Mercury_7"]["choices"]["label"] == L4
    assert rows["Mercury_1"]["passage"] == "Mars is the planet closest to the Sun."
    assert rows["Mercury_1"]["verified"] is True and rows["Mercury_2"]["verified"] is False
    assert rows["Mercury_1"]["source"] == "faitheval-counterfactual+arc-challenge"
    # one join per split the FaithEval ids point into; NoArc_9 joins nowhere
    assert imported.counts.joined == {"train": 1, "validation": 1, "test": 6}


def test_each_filter_reason_is_counted(imported):
    c = imported.counts
    assert dict(c.dropped["counterfactual"]) == {hub.NO_ARC_ROW: 1, hub.KEY_NOT_AMONG_LABELS: 1,
                                                  hub.GOLD_EQUALS_CF: 1, hub.EMPTY_PASSAGE: 1,
                                                  hub.FAILED_VALIDATION: 1}
    assert dict(c.dropped["unanswerable"]) == {hub.EMPTY_PASSAGE: 1, hub.DUPLICATE_ID: 1}
    for rid in ("Mercury_4", "Mercury_5", "Mercury_6", "Mercury_8", "NoArc_9", "un-2"):
        assert rid not in imported.rows
    assert any("NoArc_9" in n and hub.NO_ARC_ROW in n for n in c.notes)
    assert any("Mercury_8" in n and "choices.text" in n for n in c.notes)
    assert c.read == {"counterfactual": {"test": 9}, "arc": {"train": 1, "validation": 1, "test": 6},
                      "unanswerable": {"test": 3}}
    assert c.written == {"counterfactual": 4, "unanswerable": 1}


def test_unanswerable_rows_have_a_passage_and_no_keys(imported):
    un = imported.rows["un-1"]
    assert un["kind"] == "unanswerable" and un["gold_key"] is None and un["cf_key"] is None
    assert un["passage"] == "Ada grew up by the sea." and un["pools"] == ["passage"] and "choices" not in un


def test_written_file_passes_validate_and_meta_records_sources(imported):
    assert memtoc_cli.main(["transfer", "validate", str(imported.out)]) == 0
    assert validate_file(imported.out).ok
    meta = json.loads(hub.meta_path(imported.out).read_text())
    assert meta["counts"]["written"] == {"counterfactual": 4, "unanswerable": 1}
    arc = meta["datasets"]["arc"]
    assert (arc["name"], arc["config"], arc["splits"]) == ("allenai/ai2_arc", "ARC-Challenge",
                                                            ["train", "validation", "test"])
    assert arc["rows"] == {"train": 1, "validation": 1, "test": 6} and all(arc["fingerprints"].values())
    assert arc["files"]["test"]["path"].endswith("allenai/ai2_arc/ARC-Challenge/test.parquet")
    assert meta["datasets"]["counterfactual"]["name"] == "Salesforce/FaithEval-counterfactual-v1.0"
    assert meta["output_sha256"] == hub.sha256_text(imported.out.read_text())


def test_bad_column_names_one_clear_error(tmp_path):
    cf = [{("passage" if k == "context" else k): v for k, v in r.items()} for r in FAITHEVAL_CF]
    src = write_fixture(tmp_path / "hubdir", cf=cf)
    with pytest.raises(TransferDataError) as e:
        hub.import_hub(tmp_path / "x.jsonl", hub.dir_loader(src, str(tmp_path / "cache")))
    msg = str(e.value)
    assert "Salesforce/FaithEval-counterfactual-v1.0" in msg and "'context'" in msg and "\n" not in msg
    assert not (tmp_path / "x.jsonl").exists()


def test_missing_split_file_names_the_path(tmp_path):
    src = write_fixture(tmp_path / "hubdir")
    hub.ARC_CHALLENGE.local_path(src, "validation").unlink()
    with pytest.raises(TransferDataError, match=r"ARC-Challenge[/\\]validation\.parquet: no such file"):
        hub.import_hub(tmp_path / "x.jsonl", hub.dir_loader(src, str(tmp_path / "cache")))


def test_cli_from_dir_and_flag_errors(imported, capsys):
    out, ver = imported.tmp / "cli.jsonl", imported.tmp / "verified.txt"
    ver.write_text("Mercury_1\n")
    assert memtoc_cli.main(["transfer", "import", "--from-dir", str(imported.src), "--cache-dir",
                            str(imported.tmp / "cache"), "--verified-ids", str(ver), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "joined 8 counterfactual rows to ARC-Challenge (train 1, validation 1, test 6)" in err
    assert "dropped 5 counterfactual (no_arc_row 1, key_not_among_labels 1, gold_equals_cf 1, empty_passage 1" in err
    assert "wrote 4 counterfactual + 1 unanswerable rows" in err
    assert out.read_text() == imported.out.read_text()
    with pytest.raises(TransferDataError, match="ROLE=REV"):
        hub.parse_revisions(["faitheval=abc"])
    assert memtoc_cli.main(["transfer", "import", "--hub", "--arc", "a.jsonl", "-o", str(out)]) != 0
    assert "leave out --counterfactual" in capsys.readouterr().err
    assert memtoc_cli.main(["transfer", "import", "--from-dir", str(imported.src), "--revision", "arc=abc",
                            "-o", str(out)]) != 0
    assert "--revision pins a Hub download" in capsys.readouterr().err


def test_hub_loader_pins_revision_and_records_commit(imported, monkeypatch):
    """The Hub path: names, configs and revisions reach `datasets`, and the resolved commit is recorded."""
    local = hub.dir_loader(imported.src, str(imported.tmp / "cache"))
    by_name = {s.name: local(s) for s in hub.HUB_SOURCES.values()}   # read before `datasets` is patched
    calls = []

    def fake_builder(name, config, revision=None, cache_dir=None):
        return SimpleNamespace(hash=f"commit-of-{revision or 'main'}")

    def fake_load(name, config, split, revision=None, cache_dir=None):
        calls.append((name, config, split, revision))
        return by_name[name].splits[split]

    monkeypatch.setattr(hub.datasets, "load_dataset_builder", fake_builder)
    monkeypatch.setattr(hub.datasets, "load_dataset", fake_load)
    out = imported.tmp / "hub.jsonl"
    hub.import_hub(out, hub.hub_loader(None, hub.parse_revisions(["arc=abc123"])), verified_ids=["Mercury_1"])
    assert ("allenai/ai2_arc", "ARC-Challenge", "validation", "abc123") in calls
    assert ("Salesforce/FaithEval-counterfactual-v1.0", None, "test", None) in calls
    meta = json.loads(hub.meta_path(out).read_text())["datasets"]
    assert meta["arc"]["revision_requested"] == "abc123" and meta["arc"]["commit"] == "commit-of-abc123"
    assert meta["unanswerable"]["commit"] == "commit-of-main" and meta["unanswerable"]["origin"] == "hub"
    assert out.read_text() == imported.out.read_text()


def test_choices_without_label_field_is_a_clear_error(tmp_path):
    arc = {k: [{**r, "choices": {"text": r["choices"]["text"]}} for r in rows] for k, rows in ARC.items()}
    src = write_fixture(tmp_path / "hubdir", arc=arc)
    with pytest.raises(TransferDataError, match=r"allenai/ai2_arc \(config ARC-Challenge, split train\): column "
                                                r"'choices' has no field 'label'"):
        hub.import_hub(tmp_path / "x.jsonl", hub.dir_loader(src, str(tmp_path / "cache")))


# --------------------------------------------------------------------------------------------------
# transfer.dataset: hub — imported once into the transfer cache, then reused (memtoc.stages.transfer.source)

def test_hub_dataset_is_imported_once_then_reused(tmp_path, monkeypatch):
    from memtoc.stages.transfer import source
    monkeypatch.setenv("MEMTOC_TRANSFER_DIR", str(tmp_path / "cache"))
    src = write_fixture(tmp_path / "hubdir")
    assert source.planned_counts("hub") == source.CARD_ROWS          # before the import: the cards' sizes
    items, info = source.load("hub", loader=hub.dir_loader(src), progress=False)
    assert source.hub_file().is_file() and info["dataset"] == "hub" and not info["plumbing"]
    assert info["import"]["counts"] and info["import"]["datasets"]      # the provenance travels with the set
    assert {i.kind for i in items} == {"counterfactual", "unanswerable"}

    def refuse(_src):
        raise AssertionError("a second load must not import again")
    again, info2 = source.load("hub", loader=refuse, progress=False)
    assert [i.id for i in again] == [i.id for i in items] and info2["sha256"] == info["sha256"]
    assert source.planned_counts("hub") is None                       # after it: the real file is counted


def test_planned_episodes_match_build_episodes(tmp_path, monkeypatch):
    from memtoc.stages.transfer import core, source
    monkeypatch.setenv("MEMTOC_TRANSFER_DIR", str(tmp_path / "cache"))
    items, _ = source.load("hub", loader=hub.dir_loader(write_fixture(tmp_path / "hubdir")), progress=False)
    cf = [i for i in items if i.kind == "counterfactual"]
    un = [i for i in items if i.kind == "unanswerable"]
    counts = {"counterfactual": len(cf), "unanswerable": len(un)}
    for forms, n_cf, n_un in ((["reference"], None, None), (["reference", "paraphrase_a"], 2, 1)):
        cut_cf, cut_un = cf[:n_cf] if n_cf else cf, un[:n_un] if n_un else un
        want = (len(core.build_episodes(cut_cf, cut_un, forms, ("value", "passage"))),
                len(core.reverse_examples(cut_cf, forms, ("value", "passage"))))
        assert source.planned_episodes(counts, n_cf, n_un, forms, ("value", "passage")) == want


def test_paper_params_run_06_on_the_hub_set():
    from memtoc.config.params import load_params
    from memtoc.config.runconfig import RunConfig
    from memtoc.core.project import REPO_ROOT
    cfg = RunConfig.of(load_params(REPO_ROOT / "params" / "paper.yaml"))
    assert cfg.transfer.dataset == "hub" and cfg.transfer.n_boot == 2000
    assert {"llama-3.1-8b-instruct", "gemma-2-9b-it"} <= set(cfg.transfer.models)     # Table 6's models


def test_notebook_06_reads_the_hub_set_the_way_its_stage_does(tmp_path, monkeypatch):
    """Notebook 06's data cell under ``transfer.dataset: hub`` (params/paper.yaml) loads the imported set, as the
    stage does; it read "hub" as a file name before ("hub: no such file"), so 06 stopped on every paper run."""
    import pandas as pd

    from memtoc.config.runconfig import RunConfig
    from memtoc.core.project import REPO_ROOT
    from memtoc.stages import transfer
    from memtoc.stages.transfer import source
    monkeypatch.setenv("MEMTOC_TRANSFER_DIR", str(tmp_path / "cache"))
    source.load("hub", loader=hub.dir_loader(write_fixture(tmp_path / "hubdir")), progress=False)   # the import
    nb = json.loads((REPO_ROOT / "notebooks" / "06_transfer.ipynb").read_text(encoding="utf-8"))
    cell = next("".join(c["source"]) for c in nb["cells"]
                if c["cell_type"] == "code" and "select_items" in "".join(c["source"]))
    ns = {"transfer": transfer, "tr": RunConfig.of({"transfer": {"dataset": "hub"}}).transfer, "json": json,
          "pd": pd, "display": lambda *a: None}
    exec(compile(cell, "06_transfer.ipynb", "exec"), ns)
    assert ns["info"]["dataset"] == "hub" and ns["cf_items"] and ns["un_items"]
