"""`memtoc run`: --set parsing, the notebook plan, config.json provenance, failure reporting.
Notebooks are not executed here (an injected executor stands in for papermill); the real
end-to-end run is tests/integration/test_pipeline_smoke.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.core.project import REPO_ROOT
from memtoc.run import pipeline

SMOKE = str(REPO_ROOT / "params" / "smoke.yaml")


def _nbdir(tmp_path, names):
    d = tmp_path / "nbs"
    d.mkdir()
    for n in names:
        (d / n).write_text("{}")
    return d


def test_parse_set_types_and_dotted_keys():
    o = pipeline.parse_set(["n_questions=20", "finetune.enabled=false", "models=[a, b]", "run_name=x",
                            "release_dir=/data/rel"])
    assert o == {"n_questions": 20, "finetune": {"enabled": False}, "models": ["a", "b"], "run_name": "x",
                 "release_dir": "/data/rel"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        pipeline.parse_set(["n_questions"])


def test_set_goes_through_validation():
    with pytest.raises(ConfigError, match="n_questions"):
        load_params(SMOKE, overrides=pipeline.parse_set(["n_questions=-3"]))


def test_plan_order_skips_and_only(tmp_path):
    d = _nbdir(tmp_path, ["03_evaluation.ipynb", "01_construction.ipynb", "04_finetuning.ipynb", "notes.ipynb"])
    P = RunConfig.load(SMOKE)
    steps = pipeline.plan(P, None, d)
    assert [s.number for s in steps] == ["01", "02", "03", "04", "05", "06", "07", "08", "09"]   # the registry's stages
    assert [s.name for s in steps if s.run] == ["01_construction", "03_evaluation", "04_finetuning"]
    assert "no notebook" in next(s for s in steps if s.number == "02").reason
    P2 = RunConfig.load(SMOKE, overrides={"finetune": {"enabled": False}})
    s4 = next(s for s in pipeline.plan(P2, None, d) if s.number == "04")
    assert not s4.run and "finetune.enabled" in s4.reason
    assert [s.name for s in pipeline.plan(P, ["03_evaluation", "01"], d)] == ["01_construction", "03_evaluation"]
    with pytest.raises(ConfigError, match="available: 01_construction"):
        pipeline.plan(P, ["07_agent"], d)


def test_run_writes_config_and_resolved_params(tmp_path):
    d = _nbdir(tmp_path, ["01_a.ipynb", "03_b.ipynb"])
    P = RunConfig.load(SMOKE, overrides={"output_root": str(tmp_path / "out")})
    seen = []

    def fake(src, dst, params_file, log_output):
        seen.append((src.name, Path(params_file)))
        dst.write_text("{}")
        # the cache of an earlier run must survive
        assert (rd / "generations" / "m" / "x.jsonl").is_file()

    rd = tmp_path / "out" / "smoke"
    (rd / "generations" / "m").mkdir(parents=True)
    (rd / "generations" / "m" / "x.jsonl").write_text('{"key": 1}\n')
    cfg = pipeline.run(P, None, notebook_dir=d, executor=fake, echo=lambda m: None)
    assert [s for s, _ in seen] == ["01_a.ipynb", "03_b.ipynb"]
    pf = seen[0][1]
    assert pf == rd / "params.yaml"
    # the resolved copy reproduces the parameters exactly, with the release folder made absolute
    assert load_params(pf) == {**P.as_params(with_run_dir=False), "release_dir": str(pipeline.resolve_release_dir(None))}
    c = json.loads((rd / "config.json").read_text())
    assert c["status"] == "ok" and c["params"]["run_name"] == "smoke"
    ok = [n for n in c["notebooks"] if n["status"] == "ok"]
    assert [n["notebook"] for n in ok] == ["01_a", "03_b"] and all(n["seconds"] >= 0 for n in ok)
    prov = c["provenance"]
    assert set(prov["packages"]) >= {"torch", "transformers", "trl", "peft", "papermill"}
    assert prov["python"] and prov["platform"]
    assert "questions_575.jsonl" in prov["release"]["sha256"]
    assert len(prov["release"]["sha256"]["questions_575.jsonl"]) == 64
    assert "commit" in prov["git"] and "dirty" in prov["git"]
    assert c["started"] and c["finished"]
    # a second invocation keeps the first in the history
    pipeline.run(P, ["03"], notebook_dir=d, executor=fake, echo=lambda m: None)
    c2 = json.loads((rd / "config.json").read_text())
    assert len(c2["history"]) == 1 and c2["only"] == ["03"]


def test_failure_names_notebook_and_copy(tmp_path):
    d = _nbdir(tmp_path, ["01_a.ipynb", "02_boom.ipynb", "03_c.ipynb"])
    P = RunConfig.load(SMOKE, overrides={"output_root": str(tmp_path / "out")})
    ran = []

    def fake(src, dst, params_file, log_output):
        ran.append(src.name)
        if "boom" in src.name:
            raise RuntimeError("cell 4 raised ValueError")

    with pytest.raises(pipeline.PipelineError) as e:
        pipeline.run(P, None, notebook_dir=d, executor=fake, echo=lambda m: None)
    msg = str(e.value)
    assert "02_boom" in msg and str(tmp_path / "out" / "smoke" / "notebooks" / "02_boom.ipynb") in msg
    assert ran == ["01_a.ipynb", "02_boom.ipynb"]    # stops at the failure
    c = json.loads((tmp_path / "out" / "smoke" / "config.json").read_text())
    assert c["status"] == "failed"
    assert [n["status"] for n in c["notebooks"] if n["notebook"] in ("01_a", "02_boom")] == ["ok", "failed"]


def test_cli_failure_exit_code(tmp_path, capsys):
    from memtoc.cli import main
    rc = main(["run", str(REPO_ROOT / "params" / "nope.yaml")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc = main(["run", SMOKE, "--set", "output_root=" + str(tmp_path), "--list"])
    assert rc == 0
