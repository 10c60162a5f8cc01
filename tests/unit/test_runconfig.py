"""The typed run config (memtoc.config.runconfig) and the vocabulary it validates against (memtoc.core.vocab)."""
from __future__ import annotations

from pathlib import Path

import pytest

from memtoc.config.params import DEFAULTS, load_params
from memtoc.config.runconfig import JudgeConfig, RunConfig, RunPaths
from memtoc.core import vocab
from memtoc.core.errors import ConfigError
from memtoc.core.project import REPO_ROOT

PARAMS = sorted((REPO_ROOT / "params").glob("*.yaml"))


@pytest.mark.parametrize("path", PARAMS, ids=[p.name for p in PARAMS])
def test_every_shipped_params_file_builds_and_reads_like_the_dict(path):
    cfg = RunConfig.load(path)
    P = load_params(path)
    assert {k: cfg[k] for k in DEFAULTS} == P          # the Mapping view is the validated dict
    assert dict(cfg)["run_dir"] == cfg.run_dir == REPO_ROOT / P["output_root"] / P["run_name"]
    assert cfg.models == tuple(P["models"]) and isinstance(cfg.models, tuple)
    assert cfg.get("n_boot") == P["n_boot"] and "models" in cfg and "nonsense" not in cfg
    assert {**cfg, "run_dir": "x"}["run_dir"] == "x"    # the stages' `{**P, ...}` idiom


def test_every_parameter_has_a_typed_field():
    """A parameter added to config.DEFAULTS still reads as cfg[key] (RunConfig.extra), but the recipe
    asks for a typed field: this test names the missing ones."""
    from memtoc.config.runconfig import _typed_fields
    assert set(DEFAULTS) - _typed_fields() == set(), "add a typed field to memtoc.config.runconfig.RunConfig"
    assert RunConfig.of({}).untyped == {}


def test_of_accepts_a_partial_dict_with_run_dir_and_is_idempotent(tmp_path):
    cfg = RunConfig.of({"n_boot": 7, "run_dir": tmp_path})
    assert cfg.n_boot == 7 and cfg.n_perm == DEFAULTS["n_perm"] and cfg.run_dir == tmp_path
    assert RunConfig.of(cfg) is cfg
    assert cfg.replace(alpha=0.01).alpha == 0.01 and cfg.replace(alpha=0.01).run_dir == tmp_path
    with pytest.raises(ConfigError, match="alpha"):
        cfg.replace(alpha=2)


def test_judge_block_is_typed():
    cfg = RunConfig.of({"judge": {"model": "smollm2-135m-instruct"}})
    assert cfg.judge == JudgeConfig("smollm2-135m-instruct", "transformers", {}, 32)
    assert cfg["judge"] == {"model": "smollm2-135m-instruct", "backend": "transformers", "backend_options": {},
                            "max_new_tokens": 32}
    assert RunConfig.of({}).judge is None


def test_unknown_extra_arm_is_an_error_naming_file_and_field(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("extra_arms: [prompting, warnings]\n")
    with pytest.raises(ConfigError) as e:
        RunConfig.load(f)
    msg = str(e.value)
    assert str(f) in msg and "'extra_arms'" in msg and "warnings" in msg and "no_protocol_sentence" in msg


@pytest.mark.parametrize("field,value", [("backend", "tgi"), ("matcher", "fuzzy"), ("dtype", "int8"),
                                         ("closed_book_variant", "lenient")])
def test_unknown_vocabulary_values_are_errors(field, value):
    with pytest.raises(ConfigError, match=f"field '{field}'.*{value}"):
        RunConfig.of({field: value}, source="x.yaml")


def test_generator_kwargs_and_variants():
    cfg = RunConfig.of({"backend_options": {"tie_margin": 0.0}, "closed_book_variant": "permissive"})
    kw = cfg.generator_kwargs()
    assert kw["backend"] == "transformers" and kw["tie_margin"] == 0.0 and kw["max_new_tokens"] == 48
    assert cfg.closed_book_variants == ["permissive", "forced"]
    assert RunConfig.of({"elicit_permissive": False}).closed_book_variants == ["forced"]


def test_paths_layout():
    p = RunPaths(Path("/r"))
    assert p.summary("evaluation") == Path("/r/summaries/evaluation.json")
    assert p.figure("headline") == Path("/r/figures/headline.png")
    assert p.episodes("reference") == Path("/r/episodes/reference.jsonl")
    assert p.scored("m") == Path("/r/scored/m") and p.scored("m", "scored_judged") == Path("/r/scored_judged/m")
    assert p.generations("m") == Path("/r/generations/m")
    assert p.adapter("m", "dpo", 1) == Path("/r/adapters/m/dpo/fold1")


def test_extra_arm_specs_cover_the_vocabulary():
    assert vocab.EXTRA_ARMS == tuple(DEFAULTS["extra_arms"])
    for spec in vocab.EXTRA_ARM_SPECS:
        assert set(spec.conditions) <= set(vocab.ALL_CONDITIONS) and set(spec.arms) <= set(vocab.ARMS)
        assert set(spec.frames) <= set(vocab.FRAMES) and set(spec.payload_kinds) <= set(vocab.PAYLOAD_KINDS)
        assert spec.section


def test_stage_blocks_are_typed_and_nested(tmp_path):
    from memtoc.config.blocks import AgentConfig, FinetuneConfig, ProbesConfig, TransferConfig
    f = tmp_path / "p.yaml"
    f.write_text("n_boot: 300\nfinetune: {max_steps: 3, target_modules: q_proj}\nagent: {protocols: [auto]}\n")
    cfg = RunConfig.load(f)
    assert isinstance(cfg.finetune, FinetuneConfig) and cfg.finetune.max_steps == 3
    assert cfg.finetune.target_modules == ("q_proj",) and cfg.finetune.to_dict()["target_modules"] == ["q_proj"]
    assert cfg.finetune.seed == cfg.seed and cfg.finetune.models == cfg.models      # run-dependent defaults
    assert isinstance(cfg.transfer, TransferConfig) and cfg.transfer.models == cfg.finetune.models
    assert isinstance(cfg.probes, ProbesConfig) and cfg.probes.sae_k == 16
    assert isinstance(cfg.agent, AgentConfig) and cfg.agent.protocols == ("auto",)
    assert cfg.agent.n_boot == 300                                  # the run's n_boot unless the block sets one
    assert RunConfig.of({"agent": {"n_boot": 20}}).agent.n_boot == 20
    # the mapping view (config.json's stage hashes) is the block as the params file gives it
    assert cfg["finetune"] == {"enabled": True, "max_steps": 3, "target_modules": "q_proj"}
    assert cfg.replace(models=["smollm2-135m-instruct", "gemma-3-270m"]).agent.models == \
        ("smollm2-135m-instruct", "gemma-3-270m")


@pytest.mark.parametrize("block,bad,field", [("finetune", {"max_steps": 0}, "finetune.max_steps"),
                                             ("transfer", {"frames": ["table"]}, "transfer.frames"),
                                             ("probes", {"strengths": [0]}, "probes.strengths"),
                                             ("agent", {"runtime": "vllm"}, "agent.runtime"),
                                             ("probes", {"nope": 1}, "unknown probes key")])
def test_stage_block_errors_name_file_and_field(tmp_path, block, bad, field):
    f = tmp_path / "p.yaml"
    f.write_text(f"{block}: {bad}\n".replace("'", '"'))
    with pytest.raises(ConfigError) as e:
        RunConfig.load(f)
    assert str(e.value).startswith(f"{f}: ") and field in str(e.value) and "\n" not in str(e.value)


def test_block_defaults_are_the_one_fallback():
    """Fallbacks of the stage functions are the run defaults (no second default of n_boot)."""
    import inspect

    from memtoc.config.blocks import BLOCKS
    from memtoc.stages import finetune
    from memtoc.stages.evaluation import judge
    from memtoc.stages.transfer import core as transfer_core
    for fn in (finetune.paired_deltas, transfer_core.arm_rates, transfer_core.arm_deltas, judge.judged_model_section):
        assert inspect.signature(fn).parameters["n_boot"].default == DEFAULTS["n_boot"], fn.__name__
    for key, cls in BLOCKS.items():
        assert DEFAULTS[key] == {"enabled": True} and cls.defaults()["enabled"] is True
        assert list(cls.defaults()) == list(getattr(RunConfig.of({}), key).to_dict()), key
