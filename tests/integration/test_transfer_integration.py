"""Notebook 06's core on the real embedded model with a handful of items (integration)."""
from __future__ import annotations

import shutil

import pytest

from memtoc.config.runconfig import RunConfig
from memtoc.generation.models import EMBEDDED
from memtoc.stages import finetune
from memtoc.stages.transfer import core, forward_table, read_summary, reverse_table, tables as transfer_tables

pytestmark = pytest.mark.integration


def test_transfer_core_forward_and_reverse(tmp_path):
    P = RunConfig.load(overrides={
        "run_name": "transfer_it", "output_root": str(tmp_path), "formulations": ["reference"],
        "n_questions": 2, "max_new_tokens": 24, "n_boot": 50, "n_perm": 50,
        "finetune": {"enabled": True, "max_steps": 1, "batch_size": 1},
        "transfer": {"n_counterfactual": 2, "n_unanswerable": 1, "formulations": ["reference"],
                     "forward_objectives": ["dpo"], "forward_folds": [0], "reverse_max_steps": 1,
                     "reverse_batch_size": 1, "reverse_eval_questions": 1}})
    rd = P.run_dir
    s1 = core.run(P, progress=False)
    rev = s1["models"][EMBEDDED]["reverse"]
    assert rev["leak_check"]["passed"] and rev["training"]["steps"] == 1 and not rev["training"]["resumed"]
    assert set(rev["deltas"]) == set(finetune.METRICS) and rev["eval_questions"] == 1
    assert "no finished adapters" in s1["models"][EMBEDDED]["forward_note"]
    # stand in for notebook 04's fold-0 DPO adapter: the reverse adapter (any finished peft adapter)
    shutil.copytree(rev["adapter"], finetune.adapter_dir(rd, EMBEDDED, "dpo", 0))
    s2 = core.run(P.replace(transfer={**P["transfer"], "reverse": False}), progress=False)
    m = s2["models"][EMBEDDED]
    assert "reverse" not in m
    f = m["forward"]["dpo_fold0"]
    for metric in ("closed_book_acc", "retention_value", "retention_passage", "abstention", "unmatched_value"):
        d = f["deltas"][metric]["pooled"]
        assert "ci95" in d and "n_units" in d
    assert f["deltas"]["closed_book_acc"]["pooled"]["n_units"] == 2
    assert f["deltas"]["abstention"]["pooled"]["n_units"] == 1
    assert f["closed_book_band"]["band"] == 0.03 and set(f["unmatched_gap"]) == {"closed_book", "value", "passage"}
    rates = m["arms"]["untreated"]["rates"]
    assert rates["closed_book_acc"]["pooled"]["n"] == 2 and rates["abstention"]["pooled"]["n"] == 1
    assert read_summary(rd)["dataset"]["plumbing"] is True and "not FaithEval" in s2["caveat"]
    assert len(forward_table(s2)) and len(reverse_table(s1)) and not len(reverse_table(s2))
    assert (rd / "transfer" / EMBEDDED / "scored_dpo_fold0.jsonl").is_file()
    assert s2["published"]["arms"][0]["model"] == "Llama-3.1-8B-Instruct"
    assert transfer_tables.plot(s2, tmp_path / "fig.png").is_file()
