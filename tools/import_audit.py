"""Audit memtoc's imports (issue 11): imports inside function bodies and private names used across modules.

    python tools/import_audit.py [--all] [PATHS...]

Prints one line per finding and the two counts. An import inside a function is allowed only for the
optional heavy extras named in OPTIONAL (GPU-only or optional packages); ``--all`` lists those too.
A private name (``_x``) is "across modules" when it is imported from another module or read as an
attribute of an imported module (``mod._x``).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# optional extras: heavy, GPU-only or not installed by default; imported where they are used
OPTIONAL = ("vllm", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "openai", "papermill",
            "nbformat", "matplotlib", "seaborn", "huggingface_hub", "gguf", "sae_lens", "safetensors",
            "tokenizers", "statsmodels", "scipy", "sklearn", "psutil", "IPython", "pyarrow", "fastapi",
            "uvicorn", "requests", "bitsandbytes", "flash_attn", "triton", "pynvml", "jinja2", "llguidance")


def audit(path: Path) -> tuple[list[str], list[str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    inner, private = [], []
    imported_modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in sub.names] if isinstance(sub, ast.Import) else [sub.module or ""]
                    rel = isinstance(sub, ast.ImportFrom) and sub.level > 0
                    top = {m.split(".")[0] for m in mods}
                    optional = not rel and all(t in OPTIONAL for t in top)
                    names = ", ".join(a.name for a in sub.names)
                    where = f"{path.relative_to(ROOT)}:{sub.lineno} in {node.name}()"
                    inner.append((optional, f"{where}: {'.' * (sub.level if rel else 0)}{mods[0]} [{names}]"))
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("memtoc")):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {'.' * node.level}{node.module or ''} "
                                   f"import {a.name}")
                imported_modules.add(a.asname or a.name)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("memtoc"):
                    imported_modules.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in imported_modules):
            private.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return inner, private


def main(argv: list[str]) -> int:
    show_all = "--all" in argv
    paths = [Path(a).resolve() for a in argv if not a.startswith("--")] or [ROOT / "memtoc"]
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))
    n_inner = n_opt = n_priv = 0
    for f in files:
        inner, private = audit(f)
        for optional, line in inner:
            n_opt += optional
            n_inner += not optional
            if show_all or not optional:
                print(("optional  " if optional else "IN-FUNCTION ") + line)
        for line in private:
            print("PRIVATE   " + line)
        n_priv += len(private)
    print(f"{n_inner} in-function imports of non-optional modules, {n_opt} of optional extras; "
          f"{n_priv} private names used across modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
