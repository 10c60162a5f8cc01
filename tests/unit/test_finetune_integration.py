"""A real LoRA adapter on the embedded model: a few SFT steps, then held-out evaluation (~1-2 min)."""
from __future__ import annotations

import json

import pytest

from memtoc.config.runconfig import RunConfig
from memtoc.stages import finetune as F


@pytest.mark.integration
def test_train_a_real_adapter_and_evaluate_it_held_out(tmp_path):
    P = RunConfig.load(None, overrides={
        "run_name": "ft_it", "output_root": str(tmp_path), "n_questions": 12, "formulations": ["reference"],
        "max_new_tokens": 24, "n_boot": 50, "n_perm": 50,
        "finetune": {"objectives": ["sft"], "folds": [0], "max_steps": 2, "batch_size": 2,
                     "train_questions_per_fold": 4, "eval_questions_per_fold": 2},
    })
    summary = F.run(P, progress=False)
    run_dir = tmp_path / "ft_it"
    ad = run_dir / "adapters" / "smollm2-135m-instruct" / "sft" / "fold0"
    rec = json.loads((ad / "training.json").read_text())
    assert rec["status"] == "finished" and rec["steps"] == 2 and rec["examples"] == 8
    assert (ad / "adapter_model.safetensors").is_file() and (ad / "loss_curve.png").is_file()
    curve = json.loads((ad / "loss_curve.json").read_text())
    assert len(curve) == 2 and all(c["loss"] > 0 for c in curve)

    # held out: the evaluated questions' chains are not in the training data
    scored = [json.loads(line) for line in (ad / "scored.jsonl").read_text().splitlines()]
    assert len(scored) == 2 * 3                     # 2 questions x 3 conditions x 1 formulation
    assert not {r["instance_id"] for r in scored} & set(rec["chains"])
    assert all(r["fold"] == 1 for r in scored)

    m = summary["models"]["smollm2-135m-instruct"]
    assert m["adapters"]["sft"]["fold0"]["resumed"] is False
    d = m["objectives"]["sft"]["deltas"]["err_abstain"]["pooled"]
    assert d["n_units"] == 2 and d["delta"] is not None
    assert (d["n_treated_only"], d["n_untreated_only"]) == (0, 0)     # no cell: the same support

    # the adapter's own forced closed-book answers, and its episodes scored against them
    own = [json.loads(line) for line in (ad / "closed_book_forced.jsonl").read_text().splitlines()]
    assert len(own) == 2 and {r["model"] for r in own} == {"smollm2-135m-instruct__sft__fold0"}
    span = {r["qkey"]: ("" if r["mem_absent"] else r["span"]) for r in own}
    assert all(r["memory_span"] == span[r["qkey"]] or r["mem_absent"] for r in scored)
    base = [json.loads(line) for line in
            (run_dir / "adapters" / "smollm2-135m-instruct" / "untreated_closed_book_forced.jsonl").read_text().splitlines()]
    cb = m["adapters"]["sft"]["fold0"]["closed_book"]["all"]
    assert cb["n"] == 2 and cb["n_correct"] + cb["n_incorrect"] + cb["n_absent"] == 2
    assert cb["untreated_n_correct"] == sum(bool(r["memory_correct"]) and not r["mem_absent"] for r in base
                                            if r["qkey"] in span)
    assert m["objectives"]["sft"]["closed_book"]["all"]["n"] == 2
    # every delta carries its support: adapter cell units = common + treated-only
    arb = sum(r["condition"] == "tool_wrong" and r["cell"] == "arb" for r in scored)
    ret = m["objectives"]["sft"]["deltas"]["retention"]["pooled"]
    assert ret["n_units"] + ret["n_treated_only"] == arb
    for metric, by_form in m["objectives"]["sft"]["deltas"].items():
        for form, c in by_form.items():
            assert {"n_treated_only", "n_untreated_only"} <= set(c), (metric, form)
    assert "passed" in m["objectives"]["sft"]["criterion"]
    on_disk = json.loads((run_dir / "summaries" / "finetuning.json").read_text())
    assert on_disk["models"]["smollm2-135m-instruct"]["objectives"]["sft"]["n_episodes"] == 6

    # a second run resumes the finished adapter and serves every reply from the cache
    again = F.run(P, progress=False)
    assert again["models"]["smollm2-135m-instruct"]["adapters"]["sft"]["fold0"]["resumed"] is True
    assert again["models"]["smollm2-135m-instruct"]["objectives"]["sft"]["deltas"] == m["objectives"]["sft"]["deltas"]
