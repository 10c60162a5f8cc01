"""Notebook 06's forward adapters on the whole pool (transfer.forward_pool: full, Table 6's adapters)."""
from __future__ import annotations

import pytest

from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.generation import models
from memtoc.generation.backends.base import Generator, Reply
from memtoc.stages import finetune
from memtoc.stages.transfer import core, forward, load_items, select_items

MODEL = "smollm2-135m-instruct"


class _Answers(Generator):
    """Every prompt answered with option A."""

    backend = "fake"

    def _generate_batches(self, prompt_list, desc):
        yield list(range(len(prompt_list))), [Reply("FINAL: A", 10, 3, 0.01, "", False) for _ in prompt_list]


def test_forward_pool_settings_are_checked():
    assert RunConfig.of({}).transfer.forward_pool == "fold"
    with pytest.raises(ConfigError, match="transfer.forward_pool"):
        RunConfig.of({"transfer": {"forward_pool": "all"}})
    with pytest.raises(ConfigError, match=r"transfer.extra_adapters.*\['dpo'\]"):
        RunConfig.of({"transfer": {"forward_pool": "full", "extra_adapters": {"dpo": "/a"}}})
    assert RunConfig.of({"transfer": {"extra_adapters": {"dpo": "/a"}}}).transfer.extra_adapters == {"dpo": "/a"}


def test_full_pool_adapters_train_on_every_pool_question(bench, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "prepare_model", lambda name, cache_dir=None: tmp_path / "base")
    monkeypatch.setattr(finetune, "train_adapter", lambda base, spec, ex, obj, ft, path, progress=True:
                        calls.append((obj, list(ex), path)) or {"steps": 3, "resumed": False, "config_hash": obj})
    cfg = RunConfig.of({"run_dir": tmp_path, "models": [MODEL], "transfer": {"forward_pool": "full"}})
    paths, records = forward.train_full_pool(cfg, MODEL, bench, progress=False)
    assert list(paths) == ["sft", "dpo"] and [c[0] for c in calls] == ["sft", "dpo"]
    assert paths["dpo"] == tmp_path / "adapters" / MODEL / "dpo" / "full"
    qids = {e.question_id for e in calls[0][1]}
    contrast = {q.id for q in bench.questions if q.near_original and q.near_original.strip() != q.gold.strip()}
    assert qids == contrast                                      # every pool question with a near value
    assert any(q.excluded for q in bench.questions if q.id in qids)              # excluded questions too
    assert records["sft"]["folds"] == [0, 1] and records["sft"]["questions"] == len(qids)
    plans, fold_examples = finetune.plan(cfg, bench)
    assert {e.question_id for ex in fold_examples.values() for e in ex} <= qids  # both folds' pairs together
    assert {e.formulation for e in calls[0][1]} == set(cfg.finetune.train_formulations)


def test_06_scores_the_full_pool_adapters_as_table_6s_arms(tmp_path, monkeypatch):
    adapter = tmp_path / "trained"
    loaded = []
    monkeypatch.setattr(forward, "train_full_pool", lambda cfg, model, bench, progress=True: (
        {"sft": adapter, "dpo": adapter}, {"sft": {"path": str(adapter)}, "dpo": {"path": str(adapter)}}))
    monkeypatch.setattr(models, "load_generator",
                        lambda name, adapter=None, **kw: loaded.append(adapter) or _Answers({"m": name, "a": str(adapter)}))
    cfg = RunConfig.of({"run_dir": tmp_path, "models": [MODEL], "n_boot": 20, "n_perm": 20,
                        "formulations": ["reference"],
                        "transfer": {"forward_pool": "full", "reverse": False, "n_counterfactual": 3,
                                     "n_unanswerable": 2}})
    cf, un = select_items(load_items("builtin")[0], cfg.transfer)
    episodes = core.build_episodes(cf, un, ["reference"], cfg.transfer.frames)
    ms = core.run_model(cfg, MODEL, episodes, cf, un, None, {}, progress=False)
    assert set(ms["forward"]) == {"sft", "dpo"} and ms["forward_note"] == ""
    assert ms["full_pool"]["dpo"]["path"] == str(adapter) and loaded == [None, adapter, adapter]
    # a model outside finetune.models gets no full-pool arm, and says why
    cfg2 = RunConfig.of({"n_boot": 20, "n_perm": 20, "formulations": ["reference"], "run_dir": tmp_path / "b", "models": [MODEL], "finetune": {"models": []},
                         "transfer": {"forward_pool": "full", "reverse": False, "models": [MODEL]}})
    ms2 = core.run_model(cfg2, MODEL, episodes, cf, un, None, {}, progress=False)
    assert ms2["forward"] == {} and "not among finetune.models" in ms2["forward_note"]


@pytest.mark.integration
def test_a_full_pool_adapter_trains_for_real_and_resumes(bench, tmp_path):
    """One real trl step on the embedded model over the whole pool's pairs, then a resume."""
    cfg = RunConfig.of({"run_dir": tmp_path, "models": [MODEL], "finetune": {"max_steps": 1, "batch_size": 2},
                        "transfer": {"forward_pool": "full", "forward_objectives": ["sft"]}})
    paths, rec = forward.train_full_pool(cfg, MODEL, bench, progress=False)
    assert (paths["sft"] / "adapter_config.json").is_file() and rec["sft"]["steps"] == 1
    assert rec["sft"]["examples"] == len(forward.full_pool_examples(cfg, bench)) and not rec["sft"]["resumed"]
    again, rec2 = forward.train_full_pool(cfg, MODEL, bench, progress=False)
    assert rec2["sft"]["resumed"] and rec2["sft"]["config_hash"] == rec["sft"]["config_hash"]
