"""The stage registry (memtoc/run/registry.py): the pipeline, the preflight and the dry run iterate it; each
stage's recorded parameters are exactly those it reads (its own and its upstream stages')."""
from __future__ import annotations

import json

import pytest

from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.core.project import REPO_ROOT
from memtoc.run import dryrun, pipeline, registry as stages

SMOKE = str(REPO_ROOT / "params" / "smoke.yaml")
ALL = ("01_construction", "02_elicitation", "03_evaluation", "04_finetuning", "05_probes", "06_transfer",
       "07_agent_loop", "08_paper", "09_verify")
SEEN: list = []


def _nbdir(tmp_path, names=ALL):
    d = tmp_path / "nbs"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / f"{n}.ipynb").write_text("{}")
    return d


def _params(tmp_path, **over):
    return RunConfig.load(SMOKE, overrides={"output_root": str(tmp_path / "out"), **over})


def _ok(src, dst, params_file, log_output):
    dst.write_text("{}")


# hooks of the throwaway stage (named by "module:function" in its registry entry)
def throwaway_preflight(cfg, source, facts):
    SEEN.append(("preflight", facts["n_analysis"]))
    if cfg.n_boot < 100:
        raise ConfigError(f"{source}: field 'n_boot': the throwaway stage needs at least 100 resamples")


def throwaway_estimate(ctx, step):
    SEEN.append(("estimate", step.name))
    return dryrun.StagePlan(step.name, True, device=ctx.device, requests=7, seconds=3.0,
                            lines=[f"  {step.name:<18} 7 throwaway requests"])


@pytest.fixture
def throwaway(monkeypatch, tmp_path):
    """A stage added through the registry alone: one entry, its notebook, its hooks."""
    SEEN.clear()
    entry = stages.Stage("10", "10_throwaway", "throwaway", block="probes", keys=("n_perm",), reads=("03",),
                         generates=False, preflight=f"{__name__}:throwaway_preflight",
                         estimate=f"{__name__}:throwaway_estimate")
    monkeypatch.setattr(stages, "STAGES", [*stages.STAGES, entry])
    d = _nbdir(tmp_path, ALL + ("10_throwaway",))
    monkeypatch.setattr(pipeline, "NOTEBOOK_DIR", d)
    return entry


def test_a_registry_entry_reaches_the_plan_the_preflight_and_the_dry_run(throwaway, tmp_path):
    P = _params(tmp_path)
    steps = {s.number: s for s in pipeline.plan(P)}
    assert steps["10"].run and steps["10"].name == "10_throwaway"
    off = {s.number: s for s in pipeline.plan(_params(tmp_path, probes={"enabled": False}))}
    assert not off["10"].run and off["10"].reason == "probes.enabled is false"     # its block's skip rule
    text = dryrun.dry_run(P, source="smoke")
    assert "10_throwaway       7 throwaway requests" in text and ("estimate", "10_throwaway") in SEEN
    assert ("preflight", 542) in SEEN
    plan = dryrun.dry_run_json(P, source="smoke")
    assert {"stage": "10_throwaway", "requests": 7, "seconds": 3.0}.items() <= plan["stages"][-1].items()
    with pytest.raises(ConfigError, match="throwaway stage needs at least 100"):   # its preflight runs before 01
        pipeline.run(_params(tmp_path, n_boot=50), None, executor=_ok, echo=lambda m: None)
    assert not (tmp_path / "out").exists()
    assert stages.stage_keys("10") == stages.stage_keys("03") + ("n_perm",) or \
        set(stages.stage_keys("10")) == set(stages.stage_keys("03")) | {"n_perm"}


def test_stage_keys_follow_what_each_stage_reads():
    assert set(stages.stage_keys("07")) >= {"agent", "models", "release"} and "finetune" not in stages.stage_keys("07")
    assert "agent" not in stages.stage_keys("04") and "agent" not in stages.stage_keys("06")
    assert "finetune" in stages.stage_keys("06") and "finetune" not in stages.stage_keys("05")
    assert set(stages.stage_keys("08")) >= {"agent", "finetune", "probes", "transfer", "judge"}
    assert stages.stage_keys("42") is None          # an unknown notebook depends on everything


def _full_run(tmp_path, P):
    d = _nbdir(tmp_path)
    pipeline.run(P, None, notebook_dir=d, executor=_ok, echo=lambda m: None)
    return d, json.loads((P.run_dir / "config.json").read_text())


def test_an_agent_only_change_reruns_07_and_leaves_04_to_06(tmp_path):
    P = _params(tmp_path)
    d, before = _full_run(tmp_path, P)
    P2 = _params(tmp_path, agent={"max_tokens_per_call": 40})
    ran = []
    pipeline.run(P2, ["07"], notebook_dir=d, executor=lambda s, dst, pf, lo: (ran.append(s.name), _ok(s, dst, pf, lo)),
                 echo=lambda m: None)
    after = json.loads((P.run_dir / "config.json").read_text())
    assert ran == ["07_agent_loop.ipynb"]
    for name in ("04_finetuning", "05_probes", "06_transfer"):
        assert after["stages"][name]["params_sha256"] == before["stages"][name]["params_sha256"]
    assert after["stages"]["07_agent_loop"]["params_sha256"] != before["stages"]["07_agent_loop"]["params_sha256"]
    # ...and the report (08) now reads a 07 made with other parameters than its own record: rerun 08 and 09
    pipeline.run(P2, ["08", "09"], notebook_dir=d, executor=_ok, echo=lambda m: None)


def test_a_finetune_change_makes_04_and_its_readers_stale(tmp_path):
    P = _params(tmp_path)
    d, _ = _full_run(tmp_path, P)
    P2 = _params(tmp_path, finetune={"max_steps": 2})
    with pytest.raises(pipeline.PipelineError) as e:
        pipeline.run(P2, ["08"], notebook_dir=d, executor=_ok, echo=lambda m: None)
    msg = str(e.value)
    assert "04_finetuning" in msg and "06_transfer" in msg and "finetune.max_steps: 1 -> 2" in msg
    assert "05_probes" not in msg and "07_agent_loop" not in msg and "02_elicitation" not in msg
    assert len(msg) < 1500 and "\n" not in msg          # names the setting, not whole blocks
    pipeline.run(P2, ["07"], notebook_dir=d, executor=_ok, echo=lambda m: None)   # 07 reads no 04 output


def test_paper_plan_as_json(capsys):
    from memtoc import cli
    assert cli.main(["run", "params/paper.yaml", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    st = {s["stage"][:2]: s for s in plan["stages"]}
    for n in ("02", "03", "04", "05", "06", "07"):
        assert st[n]["enabled"] and st[n]["seconds"] and st[n]["seconds"] > 0, n
    assert st["05"]["device"] == "cuda" and plan["total_seconds"] > 0 and plan["gpu_gb"] >= 40
    assert cli.main(["run", "params/scale70b.yaml", "--dry-run", "--json"]) == 0
    st = {s["stage"][:2]: s for s in json.loads(capsys.readouterr().out)["stages"]}
    assert not st["05"]["enabled"] and not st["06"]["enabled"] and st["03"]["enabled"]
