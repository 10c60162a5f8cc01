"""A project folder records where its release copies and models live (``memtoc-paths.json``, written by
``memtoc init DIR --data-dir ... --model-cache ...``), read after the environment variables and before
the per-user defaults: a restarted kernel or a new Colab session started in the folder finds its data."""
from __future__ import annotations

import json

import pytest

from memtoc import cli
from memtoc.config import params
from memtoc.core import project
from memtoc.core.errors import ConfigError
from memtoc.generation import weights


@pytest.fixture
def proj(tmp_path, monkeypatch):
    root = tmp_path / "memtoc-work"
    root.mkdir()
    monkeypatch.setattr(project, "REPO_ROOT", root)
    monkeypatch.delenv("MEMTOC_DATA_DIR", raising=False)
    monkeypatch.delenv("MEMTOC_MODEL_CACHE", raising=False)
    return root


def test_the_recorded_folders_are_found_without_environment_variables(proj, monkeypatch, tmp_path):
    home_default = params.release_cache_root()
    assert home_default.parts[-3:] == (".cache", "memtoc", "release") and project.project_paths() == {}
    project.write_project_paths(proj, data_dir="release", model_cache=str(tmp_path / "models"))
    assert params.release_cache_root() == proj / "release"                  # relative: from the project folder
    assert weights.model_cache_root() == tmp_path / "models"
    monkeypatch.setenv("MEMTOC_DATA_DIR", str(tmp_path / "env"))             # the environment still wins
    monkeypatch.setenv("MEMTOC_MODEL_CACHE", str(tmp_path / "envm"))
    assert params.release_cache_root() == tmp_path / "env" and weights.model_cache_root() == tmp_path / "envm"
    assert weights.model_cache_root(tmp_path / "arg") == tmp_path / "arg"    # and an explicit argument first


def test_memtoc_init_records_them(proj, capsys, monkeypatch):
    dest = proj.parent / "colab-project"
    assert cli.main(["init", str(dest), "--data-dir", "release", "--model-cache", "models"]) == 0
    assert json.loads((dest / project.PATHS_FILE).read_text()) == {"data_dir": "release", "model_cache": "models"}
    assert "records data_dir" in capsys.readouterr().out
    monkeypatch.setattr(project, "REPO_ROOT", dest)
    assert params.release_cache_root() == dest / "release" and weights.model_cache_root() == dest / "models"
    assert cli.main(["init", str(dest), "--model-cache", "/elsewhere"]) == 0      # one field over the other kept
    assert project.project_paths(dest) == {"data_dir": dest / "release", "model_cache": project.Path("/elsewhere")}


@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"data_dirr": "x"}', "field 'data_dirr' is unknown"),
    ('{"model_cache": 3}', "field 'model_cache' must be a folder path"),
])
def test_a_damaged_file_is_one_line_naming_file_field_and_fix(proj, text, words):
    (proj / project.PATHS_FILE).write_text(text)
    with pytest.raises(ConfigError, match=words) as e:
        params.release_cache_root()
    assert str(proj / project.PATHS_FILE) in str(e.value)
    with pytest.raises(ConfigError):                     # and it is not overwritten by a new record
        project.write_project_paths(proj, data_dir="release")
    assert (proj / project.PATHS_FILE).read_text() == text


def test_setup_py_loads_the_project_module_with_the_standard_library_only():
    """setup.py executes memtoc/core/project.py on its own (for PROJECT_FILES) inside pip's isolated
    build environment, where memtoc is not importable: the module must import the standard library only.
    ``-I -S`` gives an interpreter without site-packages, hence without memtoc."""
    import subprocess
    import sys
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('_p', {str(project.__file__)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "assert 'memtoc' not in sys.modules; print(len(m.PROJECT_FILES))")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) == len(project.PROJECT_FILES)


def test_the_paper_models_download_into_the_recorded_hub_cache(proj, monkeypatch, tmp_path):
    """Colab keeps the ~80 GB of paper weights on Drive only if the hub downloads go there: memtoc passes
    the project's recorded ``hub_cache`` to ``snapshot_download``, unless HF_HUB_CACHE / HF_HOME decide."""
    import huggingface_hub

    from memtoc.generation import models
    for var in ("HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.append((repo, kw.get("cache_dir"))) or str(tmp_path / "snap"))
    spec = models.get_model("qwen2.5-7b-instruct")
    models._prepare_hub(spec)
    assert asked[-1] == (spec.hub_id, None)                                  # nothing recorded: the hub's own
    project.write_project_paths(proj, hub_cache="hub")
    models._prepare_hub(spec)
    assert asked[-1] == (spec.hub_id, str(proj / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))                     # the environment still wins
    models._prepare_hub(spec)
    assert asked[-1] == (spec.hub_id, None)
    assert cli.main(["init", str(proj), "--hub-cache", "elsewhere"]) == 0
    assert project.project_paths(proj)["hub_cache"] == proj / "elsewhere"
