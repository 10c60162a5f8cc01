"""Build hook: a wheel carries the project files (notebooks/, params/, paper/claims.yaml,
paper/published/, requirements/*.lock) as ``memtoc/_resources/``; ``memtoc init DIR`` copies them
into a project folder (memtoc/core/project.py). Everything else is in pyproject.toml.

An editable install (``pip install -e .``) copies nothing: memtoc then reads the clone itself.
"""
import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_memtoc_project", HERE / "memtoc" / "core" / "project.py")
_project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_project)
_SKIP = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.pyc")


class BuildPyWithResources(build_py):
    """``build_py`` plus a copy of ``project.PROJECT_FILES`` into ``memtoc/_resources/``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "memtoc" / "_resources"
        for rel in _project.PROJECT_FILES:
            src = HERE / rel
            if rel.endswith("/") and src.is_dir():
                shutil.copytree(src, dest / rel, ignore=_SKIP, dirs_exist_ok=True)
            elif src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)


setup(cmdclass={"build_py": BuildPyWithResources})
