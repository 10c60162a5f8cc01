"""memtoc installed from a wheel: the project root is the working folder (memtoc/core/project.py), never
the installed package; ``memtoc init DIR`` writes the shipped notebooks, params and paper files.
The last test builds a real wheel, installs it into a fresh interpreter and runs notebook 01 from a
``memtoc init`` folder (~1 min)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from memtoc.cli import init as initcmd
from memtoc.config.params import resolve_release_dir
from memtoc.core import project
from memtoc.core.errors import ConfigError
from memtoc.core.project import REPO_ROOT


def test_clone_root_is_the_repository(monkeypatch):
    monkeypatch.delenv(project.HOME_ENV, raising=False)
    assert project.is_source_checkout()
    assert project.project_root(Path("/")) == project.SOURCE_ROOT == REPO_ROOT
    assert project.bundled_resources() == project.SOURCE_ROOT


def test_installed_root_is_the_working_project_folder(monkeypatch, tmp_path):
    """As from a wheel (the package's parent is site-packages, no pyproject.toml there)."""
    site = tmp_path / "site-packages"
    (site / "memtoc").mkdir(parents=True)
    monkeypatch.setattr(project, "SOURCE_ROOT", site)
    monkeypatch.setattr(project, "RESOURCES_DIR", site / "memtoc" / "_resources")
    monkeypatch.delenv(project.HOME_ENV, raising=False)
    work = tmp_path / "work"
    (work / "params").mkdir(parents=True)
    (work / "notebooks").mkdir()
    assert project.project_root(work / "notebooks") == work          # a notebook opened in work/notebooks
    assert project.project_root(tmp_path) == tmp_path.resolve()      # no project above: the working folder
    monkeypatch.setenv(project.HOME_ENV, str(work))
    assert project.project_root(tmp_path) == work
    assert project.bundled_resources() is None
    with pytest.raises(ConfigError, match="carries no project files"):
        initcmd.init_project(tmp_path / "x")


def test_init_copies_the_project_files_and_keeps_edits(tmp_path, capsys):
    dest = tmp_path / "work"
    assert initcmd.cli([str(dest)]) == 0
    assert "memtoc run params/smoke.yaml" in capsys.readouterr().out
    for rel in ("notebooks/01_construction.ipynb", "params/smoke.yaml", "paper/claims.yaml", "requirements/cpu.lock"):
        assert (dest / rel).read_bytes() == (REPO_ROOT / rel).read_bytes()
    assert project.is_project_dir(dest) and (dest / "outputs").is_dir()
    published = REPO_ROOT / "paper" / "published"
    if published.is_dir():
        assert sorted(p.name for p in (dest / "paper" / "published").iterdir()) == \
            sorted(p.name for p in published.iterdir() if p.is_file())
    assert initcmd.init_project(dest) == []                          # identical files: nothing to do
    (dest / "params" / "smoke.yaml").write_text("n_boot: 3\n")
    with pytest.raises(ConfigError, match=r"params/smoke.yaml.*--force"):
        initcmd.init_project(dest)
    assert initcmd.init_project(dest, force=True) == ["params/smoke.yaml"]
    with pytest.raises(ConfigError, match="where the project files come from"):
        initcmd.init_project(REPO_ROOT)


_SOURCES = ("memtoc", "notebooks", "params", "paper", "requirements", "pyproject.toml", "setup.py", "MANIFEST.in",
            "README.md")


def _files(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"               # a copy: the build writes build/ and *.egg-info beside the sources
    for name in _SOURCES:
        s = REPO_ROOT / name
        if s.is_dir():
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.egg-info"))
        elif s.is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("memtoc-*.whl")
    return wheel


def _fresh_python(tmp_path: Path, wheel: Path) -> tuple[Path, Path]:
    """A venv without pip whose only memtoc is the wheel; the other packages through a .pth line."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return py, site


@pytest.mark.integration
def test_wheel_install_runs_from_an_init_folder(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for rel in ("notebooks/01_construction.ipynb", "params/smoke.yaml", "paper/claims.yaml", "requirements/cpu.lock"):
        assert f"memtoc/_resources/{rel}" in names, rel
    py, site = _fresh_python(tmp_path, wheel)
    env = dict(os.environ, MEMTOC_RELEASE=str(resolve_release_dir()), HF_HUB_OFFLINE="1")
    env.pop(project.HOME_ENV, None)
    env.pop("MEMTOC_PROGRESS_FILE", None)
    where = subprocess.run([str(py), "-c", "import memtoc.config.params as c; print(c.__file__); print(c.REPO_ROOT)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(site / "memtoc" / "config" / "params.py"), str(tmp_path.resolve())]
    before = _files(site / "memtoc")
    work = tmp_path / "work"
    r = subprocess.run([str(py), "-m", "memtoc", "init", str(work)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    run_name = f"wheel_check_{os.getpid()}"
    r = subprocess.run([str(py), "-m", "memtoc", "run", "params/smoke.yaml", "--only", "01_construction",
                        "--set", f"run_name={run_name}"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rd = work / "outputs" / run_name
    assert (rd / "episodes" / "reference.jsonl").stat().st_size > 0
    assert (rd / "notebooks" / "01_construction.ipynb").is_file() and (rd / "config.json").is_file()
    assert not (REPO_ROOT / "outputs" / run_name).exists()
    assert _files(site / "memtoc") == before                        # nothing written into the installation
    assert not any(p.name == "outputs" for p in site.rglob("outputs"))


def test_the_departures_table_travels_with_the_project(tmp_path, monkeypatch):
    from memtoc.stages import report
    assert "| item | paper | memtoc | reason |" in report.departures_markdown()
    dest = tmp_path / "work"
    initcmd.init_project(dest)
    assert (dest / "docs" / "departures.md").read_bytes() == (REPO_ROOT / "docs" / "departures.md").read_bytes()
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path / "nowhere")
    monkeypatch.setattr(report, "bundled_resources", lambda: None)
    assert "docs/departures.md is not in this project folder" in report.departures_markdown()   # no crash
