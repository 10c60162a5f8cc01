"""`memtoc merge`: shards that each ran one model, merged, give the summaries of one run of both.

The unit tests build shard records by hand (no model); the integration test runs the two embedded
models as two shards and as one run (stages 01–03 at a tiny size) and compares the summaries."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import ConfigError, DataError
from memtoc.core.project import REPO_ROOT
from memtoc.generation.models import EMBEDDED, EMBEDDED_BASE
from memtoc.run.merge import check_compatible, merge, read_shard

TINY = ["n_questions=2", "n_questions_extra=0", "extra_arms=[]", "formulations=[reference,paraphrase_a]",
        "max_new_tokens=12", "n_boot=40", "n_perm=40", "elicit_permissive=false", "finetune.enabled=false",
        "transfer.enabled=false", "probes.enabled=false", "agent.enabled=false"]


def _shard(tmp: Path, name: str, models: list[str], **changes) -> Path:
    rd = tmp / name
    params = {"run_name": name, "models": models, "n_questions": 2, "max_new_tokens": 12, "judge": None,
              "batch_size": "auto"}
    cfg = {"status": "ok", "params": params, "stages": {"02_elicitation": {}},
           "provenance": {"release": {"digest": "r1"}, "git": {"commit": "c1"}}}
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    rd.mkdir()
    RunPaths(rd).config_json.write_text(json.dumps(cfg))
    return rd


def _check(tmp: Path, **changes) -> None:
    shards = [_shard(tmp, "a", [EMBEDDED]), _shard(tmp, "b", [EMBEDDED_BASE], **changes)]
    check_compatible(shards, [read_shard(s) for s in shards])


def test_compatible_shards_differ_only_in_models_and_where_files_go(tmp_path):
    _check(tmp_path, params__batch_size=8, params__run_name="other")


@pytest.mark.parametrize("change, field", [
    ({"params__max_new_tokens": 48}, "params.max_new_tokens"),
    ({"provenance__release__digest": "r2"}, "provenance.release.digest"),
    ({"provenance__git__commit": "c2"}, "provenance.git.commit"),
    ({"params__models": [EMBEDDED]}, "params.models"),
])
def test_incompatible_shard_names_its_file_and_field(tmp_path, change, field):
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, **change)
    msg = str(e.value)
    assert f"{tmp_path / 'b' / 'config.json'}: field '{field}'" in msg and "\n" not in msg


def test_unfinished_or_missing_shard_is_refused(tmp_path):
    a = _shard(tmp_path, "a", [EMBEDDED])
    b = _shard(tmp_path, "b", [EMBEDDED_BASE], status="failed")
    with pytest.raises(DataError, match="field 'status'"):
        merge(tmp_path / "out", [a, b])
    with pytest.raises(DataError, match="does not exist"):
        merge(tmp_path / "out", [a, tmp_path / "nowhere"])
    assert not (tmp_path / "out").exists()


def _run(out_root: Path, name: str, models: list[str]) -> Path:
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    sets = [*TINY, f"output_root={out_root}", f"run_name={name}", f"models=[{','.join(models)}]"]
    cmd = [sys.executable, "-m", "memtoc", "run", str(REPO_ROOT / "params" / "smoke.yaml"),
           "--only", "01", "02", "03", *[x for s in sets for x in ("--set", s)]]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out_root / name


def _summary(rd: Path, stage: str) -> dict:
    d = json.loads(RunPaths(rd).summary(stage).read_text())
    d.pop("run_name", None)
    return d


@pytest.mark.integration
def test_merged_shards_equal_one_run_of_both_models(tmp_path):
    a = _run(tmp_path, "shard_a", [EMBEDDED])
    b = _run(tmp_path, "shard_b", [EMBEDDED_BASE])
    # the single run is served from the shards' generation caches (the same replies, no second generation)
    for shard, model in ((a, EMBEDDED), (b, EMBEDDED_BASE)):
        shutil.copytree(RunPaths(shard).generations(model), RunPaths(tmp_path / "both").generations(model))
    both = _run(tmp_path, "both", [EMBEDDED, EMBEDDED_BASE])
    out = tmp_path / "merged"
    r = merge(out, [a, b])
    assert r["recomputed"] == ["01_construction", "02_elicitation", "03_evaluation"] and not r["left"]
    assert r["report"] is not None and r["report"].is_file()
    for stage in ("construction", "elicitation", "evaluation"):
        assert _summary(out, stage) == _summary(both, stage), stage
    ev = _summary(out, "evaluation")
    assert set(ev["models"]) == {EMBEDDED, EMBEDDED_BASE} and ev["ranking_stability"]
    # the merged directory is a run `memtoc run --only` accepts: its stage records match its params
    env = dict(os.environ, MPLBACKEND="Agg")
    listing = subprocess.run([sys.executable, "-m", "memtoc", "run", str(RunPaths(out).params_yaml), "--list"],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr


def test_a_merge_that_fails_leaves_no_half_merged_run(tmp_path):
    a, b = _shard(tmp_path, "a", [EMBEDDED]), _shard(tmp_path, "b", [EMBEDDED_BASE])
    RunPaths(a).episodes("reference").parent.mkdir(parents=True)
    RunPaths(a).episodes("reference").write_text('{"id": 1}\n')
    with pytest.raises(DataError, match="differs from"):       # b built no such episodes
        merge(tmp_path / "out", [a, b])
    RunPaths(b).episodes("reference").parent.mkdir(parents=True)
    RunPaths(b).episodes("reference").write_text('{"id": 1}\n')
    with pytest.raises(DataError, match="elicitation.json does not exist"):   # 02's summary missing
        merge(tmp_path / "out", [a, b])
    RunPaths(a).write_summary("elicitation", {"n_questions": 2})
    with pytest.raises(DataError, match="closed_book_forced.jsonl does not exist"):   # 02's rows missing
        merge(tmp_path / "out", [a, b])
    assert not (tmp_path / "out").exists()
