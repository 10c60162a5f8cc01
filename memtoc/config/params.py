"""Run parameters: defaults, validation with clear errors, release-dir resolution.

Every notebook receives the same flat parameter dict from papermill (see ``params/*.yaml``).
``load_params`` reads a YAML file, merges it over ``DEFAULTS`` and validates it; errors name the
file, the field and the fix.
"""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

import yaml

from memtoc.config.judge import JudgeConfig
from memtoc.core.errors import ConfigError, DataError, MemtocError, check_choice, check_choices, ordered_subset  # noqa: F401
from memtoc.core.project import REPO_ROOT, project_paths  # noqa: F401  (REPO_ROOT re-exported: memtoc.config.params.REPO_ROOT)
from memtoc.core.vocab import BACKENDS, CLOSED_BOOK_VARIANTS, DTYPES, EXTRA_ARMS, FORMULATIONS, MATCHERS

PAPER_SEED = 20260721


def section_params(P: dict[str, Any], key: str, defaults: dict[str, Any], source: str = "<params>",
                   see: str = "params/default.yaml") -> dict[str, Any]:
    """A deep copy of ``defaults`` overlaid with the mapping ``P[key]``; refuses a non-mapping and
    unknown keys (the error names the field and the valid keys)."""
    raw = P.get(key) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: field '{key}' must be a mapping (see {see})")
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        raise ConfigError(f"{source}: unknown {key} key(s) {unknown}; valid keys are: {', '.join(defaults)}")
    out = copy.deepcopy(defaults)
    out.update(copy.deepcopy(raw))
    return out


RELEASE_STAMP = "memtoc-release.json"   # written by `memtoc data fetch` beside a verified copy
# The rules of resolve_release, in order (the second element of its answer).
RELEASE_RULES = ("argument", "params:release_dir", "env:MEMTOC_RELEASE", "fetched", "beside-repository")


def release_cache_root() -> Path:
    """Where `memtoc data fetch` installs verified copies: ``$MEMTOC_DATA_DIR``, else the project's
    recorded ``data_dir`` (``memtoc-paths.json``, :func:`memtoc.core.project.project_paths`), else
    ``~/.cache/memtoc/release`` (one folder per commit, ``local-<sha12>`` for a local source)."""
    if os.environ.get("MEMTOC_DATA_DIR"):
        return Path(os.environ["MEMTOC_DATA_DIR"]).expanduser()
    return project_paths().get("data_dir") or Path.home() / ".cache" / "memtoc" / "release"


def fetched_release(root: Path | None = None) -> Path | None:
    """The newest copy under ``root`` (default :func:`release_cache_root`) whose
    ``memtoc-release.json`` stamp records a passed verification; None when there is none."""
    root = release_cache_root() if root is None else root
    best: tuple[str, Path] | None = None
    for stamp in sorted(root.glob(f"*/{RELEASE_STAMP}")) if root.is_dir() else []:
        try:
            s = json.loads(stamp.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(s, dict) and isinstance(s.get("verification"), dict) \
                and s["verification"].get("status") == "PASS" and (best is None or str(s.get("date")) > best[0]):
            best = (str(s.get("date")), stamp.parent)
    return best[1].resolve() if best else None


def resolve_release(release_dir: str | os.PathLike | None = None,
                    params: dict[str, Any] | None = None) -> tuple[Path, str]:
    """Find the benchmark release directory and say which rule found it.

    Order (the first rule that names a folder decides; a named folder that does not exist is an
    error, not a fall-through): the explicit argument (``--release DIR``) -> ``"argument"``; the
    parameter ``release_dir`` of ``params`` -> ``"params:release_dir"``; ``$MEMTOC_RELEASE`` ->
    ``"env:MEMTOC_RELEASE"``; the newest verified copy installed by ``memtoc data fetch`` under
    :func:`release_cache_root` -> ``"fetched"``; ``../shared/memtoc-release`` beside the repository
    (or the working directory) -> ``"beside-repository"``. Relative paths are taken from the
    working directory.
    """
    named = [(release_dir, RELEASE_RULES[0]), ((params or {}).get("release_dir"), RELEASE_RULES[1]),
             (os.environ.get("MEMTOC_RELEASE"), RELEASE_RULES[2])]
    given = next(((Path(v).expanduser(), rule) for v, rule in named if v), None)
    if given is None:
        fetched = fetched_release()
        if fetched is not None:
            return fetched, RELEASE_RULES[3]
    candidates = [given] if given else [(c, RELEASE_RULES[4]) for c in (
        REPO_ROOT.parent / "shared" / "memtoc-release", Path.cwd().parent / "shared" / "memtoc-release",
        Path.cwd() / "../shared/memtoc-release")]
    tried: list[str] = []
    for c, rule in candidates:
        c = c if c.is_absolute() else (Path.cwd() / c)
        tried.append(str(c.resolve()))
        if c.is_dir():
            return c.resolve(), rule
    where = f" ({given[1]})" if given else f", and no verified copy under {release_cache_root()}"
    raise DataError(
        "MemToC benchmark data not found; looked in: " + ", ".join(tried) + where + ". "
        "Run `memtoc data fetch` to download and verify the official release, or point memtoc at a "
        "copy (the compact ../shared/memtoc-release or the official layout) with `--release DIR`, "
        "the parameter release_dir, or the environment variable MEMTOC_RELEASE."
    )


def resolve_release_dir(release_dir: str | os.PathLike | None = None) -> Path:
    """The benchmark release directory (:func:`resolve_release` without the rule)."""
    return resolve_release(release_dir)[0]


# The flat parameter set shared by every notebook.  Keep in sync with params/*.yaml and README.
DEFAULTS: dict[str, Any] = {
    "run_name": "default",
    "output_root": "outputs",
    "release_dir": None,             # None -> $MEMTOC_RELEASE -> fetched copy -> ../shared (resolve_release)
    "seed": PAPER_SEED,
    # models and generation
    "models": ["smollm2-135m-instruct"],
    "backend": "transformers",       # transformers | vllm | openai
    "backend_options": {},           # e.g. {"base_url": ..., "api_key": ...} for openai
    "batch_size": "auto",
    "dtype": "auto",
    "max_new_tokens": 48,
    "model_cache_dir": None,         # where `memtoc model prepare` puts safetensors (None: user cache)
    # benchmark slice
    "formulations": list(FORMULATIONS),
    # the formulations a base (non-chat) model runs: the paper reports its base model on the
    # Reference formulation only (PROTOCOL §6); null = all of `formulations` (the release generated them)
    "base_formulations": ["reference"],
    "n_questions": 542,              # headline analysis: closed-book + 4 core conditions
    "n_questions_extra": 60,         # extra arms (far, payloads, noop, prompting, frames)
    "closed_book_variant": "forced",  # forced (primary) | permissive
    "elicit_permissive": True,       # also elicit the permissive variant (for comparison)
    "extra_arms": list(EXTRA_ARMS),    # memtoc.core.vocab.EXTRA_ARM_SPECS
    # scoring and statistics
    "matcher": "paper",              # paper | strict
    "n_boot": 1000,                 # the release's bootstrap size (PROTOCOL §6)
    "n_perm": 10000,
    "alpha": 0.05,
    # fine-tuning
    "finetune": {"enabled": True},
    # transfer beyond MemToC (notebook 06; keys and defaults: memtoc.config.blocks.TransferConfig)
    "transfer": {"enabled": True},
    # the probes (notebook 05; keys and defaults: memtoc.config.blocks.ProbesConfig)
    "probes": {"enabled": True},
    # the agent loop (notebook 07; keys and defaults: memtoc.config.blocks.AgentConfig)
    "agent": {"enabled": True},
    # the LLM-judge overlay (PROTOCOL §4b, the "judged" layer; memtoc/stages/evaluation/judge.py): null = det only.
    # {model: <registry name or local dir>, backend: transformers|vllm|openai, backend_options: {...},
    #  max_new_tokens: 32}
    "judge": None,
    # report / verification
    "verify": True,
}

def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def validate_params(params: dict[str, Any], source: str = "<params>") -> dict[str, Any]:
    """Merge ``params`` over DEFAULTS and check types/ranges. Returns the resolved dict."""
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: the parameter file must be a YAML mapping, got {type(params).__name__}")
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"{source}: unknown parameter(s) {unknown}; valid parameters are: {', '.join(DEFAULTS)}")
    p = _merge(DEFAULTS, params)

    def fail(field: str, msg: str) -> None:
        raise ConfigError(f"{source}: field {field!r}: {msg}")

    if not is_plain_name(p["run_name"]):
        fail("run_name", f"must be a plain folder name (letters, digits, '.', '_', '-'; not '.' or '..', no "
                         f"'/' or '\\'), got {p['run_name']!r}: the run directory is <output_root>/<run_name>")
    if not isinstance(p["output_root"], str) or not p["output_root"]:
        fail("output_root", f"must be a folder path, got {p['output_root']!r}")
    if p["release_dir"] is not None and (not isinstance(p["release_dir"], str) or not p["release_dir"]):
        fail("release_dir", f"must be a folder path or null (then $MEMTOC_RELEASE), got {p['release_dir']!r}")
    if p["model_cache_dir"] is not None and (not isinstance(p["model_cache_dir"], str) or not p["model_cache_dir"]):
        fail("model_cache_dir", f"must be a folder path or null, got {p['model_cache_dir']!r}")
    for field in ("verify", "elicit_permissive"):
        if not isinstance(p[field], bool):
            fail(field, f"must be true or false, got {p[field]!r}")
    if not isinstance(p["backend_options"], dict):
        fail("backend_options", f"must be a mapping of backend options (e.g. {{gpu_memory_utilization: 0.85}}), "
                                f"got {p['backend_options']!r}")
    if not isinstance(p["models"], list) or not p["models"] or not all(isinstance(m, str) for m in p["models"]):
        fail("models", "must be a non-empty list of model names or local HF paths")
    for field, what, valid in (("backend", "backend", BACKENDS), ("closed_book_variant", "closed-book variant",
                               CLOSED_BOOK_VARIANTS), ("matcher", "matcher", MATCHERS), ("dtype", "dtype", DTYPES)):
        if p[field] not in valid:
            fail(field, f"unknown {what} {p[field]!r}; valid {what}s are: {', '.join(valid)}")
    if not isinstance(p["formulations"], list) or not p["formulations"]:
        fail("formulations", f"must be a non-empty list drawn from {list(FORMULATIONS)}")
    try:
        check_choices("formulation", p["formulations"], FORMULATIONS)
    except ConfigError as e:
        fail("formulations", str(e))
    bf = p["base_formulations"]
    if bf is not None and (not isinstance(bf, list) or not bf or any(v not in p["formulations"] for v in bf)):
        fail("base_formulations", f"must be null (all of formulations) or a non-empty list drawn from "
                                  f"formulations {p['formulations']}, got {bf!r}")
    for field, what in (("formulations", "formulation"), ("models", "model"), ("extra_arms", "extra arm")):
        if isinstance(p[field], list):
            reps = sorted({str(v) for v in p[field] if p[field].count(v) > 1})
            if reps:
                fail(field, f"repeated {what}(s) {reps}: list each {what} once")
    for field in ("n_questions_extra", "seed"):
        if not isinstance(p[field], int) or isinstance(p[field], bool) or p[field] < 0:
            fail(field, f"must be a non-negative integer, got {p[field]!r}")
    for field in ("n_questions", "max_new_tokens", "n_boot", "n_perm"):
        if not isinstance(p[field], int) or isinstance(p[field], bool) or p[field] < 1:
            fail(field, f"must be a positive integer (at least 1), got {p[field]!r}")
    if not (p["batch_size"] == "auto" or (isinstance(p["batch_size"], int) and p["batch_size"] > 0)):
        fail("batch_size", "must be a positive integer or 'auto'")
    if not isinstance(p["extra_arms"], list):
        fail("extra_arms", "must be a list")
    unknown = [a for a in p["extra_arms"] if a not in EXTRA_ARMS]
    if unknown:     # never a silent drop: an arm nobody analyses would spend compute for nothing
        fail("extra_arms", f"unknown extra arm(s) {unknown}; valid extra arms are: {', '.join(EXTRA_ARMS)} "
                           "(memtoc.core.vocab.EXTRA_ARM_SPECS; docs/architecture.md, recipe 'add an arm')")
    a = p["alpha"]
    if not isinstance(a, (int, float)) or isinstance(a, bool) or not (0 < a < 1):
        fail("alpha", f"must be a number in (0, 1), e.g. 0.05, got {a!r}")
    if not isinstance(p["finetune"], dict):
        fail("finetune", "must be a mapping (see params/finetune.yaml)")
    if not isinstance(p["transfer"], dict):
        fail("transfer", "must be a mapping (keys: memtoc.config.blocks.TransferConfig; see params/default.yaml)")
    if not isinstance(p["probes"], dict):
        fail("probes", "must be a mapping (keys: memtoc.config.blocks.ProbesConfig; see params/probes.yaml)")
    if not isinstance(p["agent"], dict):
        fail("agent", "must be a mapping (keys: memtoc.config.blocks.AgentConfig; see params/agent.yaml)")
    if p["judge"] is not None:
        p["judge"] = check_judge(p["judge"], fail)
    return p


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def is_plain_name(name: Any) -> bool:
    """A single path component that stays inside its parent: no separators, not ``.``/``..``."""
    return isinstance(name, str) and bool(_PLAIN_NAME.match(name)) and name not in (".", "..")


def check_judge(j: Any, fail) -> dict[str, Any]:
    """The ``judge`` block with its defaults (``memtoc.config.judge.JudgeConfig``: backend transformers,
    no options, 32 new tokens) as a mapping."""
    return JudgeConfig.resolve(j, fail).to_dict()


EXTENDS = "extends"


def _read_yaml(path: Path) -> dict[str, Any]:
    """One parameter file as a mapping (empty file: {}), or a ConfigError naming the file."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the "
                          "parameter file as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the parameter file ({e.strerror})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the parameter file must be a YAML mapping (key: value lines, see "
                          f"params/default.yaml), got a {type(raw).__name__}")
    return raw


def read_params_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A parameter file's own keys over those of the file it ``extends`` (a path relative to the file's
    folder; nested mappings merge key by key, lists and other values replace), recursively."""
    raw = _read_yaml(path)
    base = raw.pop(EXTENDS, None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: field '{EXTENDS}' must name one parameter file (e.g. extends: paper.yaml), "
                          f"got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in _seen or base_path == path.resolve():
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve(), base_path))
        raise ConfigError(f"{path}: field '{EXTENDS}' makes a cycle ({chain}); remove one of the extends lines")
    if not base_path.is_file():
        raise ConfigError(f"{path}: field '{EXTENDS}': {base_path} does not exist (the path is relative to "
                          f"{path.parent})")
    return _merge(read_params_file(base_path, (*_seen, path.resolve())), raw)


def load_params(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a params YAML (its own keys over the file it ``extends``, if any; or just the defaults when
    ``path`` is None) and validate it."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file() and not (REPO_ROOT / "params").is_dir():
            raise ConfigError(f"parameter file {path} does not exist, and {REPO_ROOT} is no memtoc project folder "
                              "(no params/); make one with `memtoc init DIR` and run memtoc from DIR (or set "
                              "MEMTOC_HOME=DIR)")
        if not path.is_file():
            raise ConfigError(f"parameter file {path} does not exist; the shipped ones are in params/ "
                              f"({', '.join(sorted(p.name for p in (REPO_ROOT / 'params').glob('*.yaml')))})")
        raw = read_params_file(path)
    if overrides:
        # the file alone first: an error the file causes names the file; one that only the overrides
        # cause names them (`--set KEY=VALUE` on the command line)
        validate_params(raw, source)
        return validate_params(_merge(raw, overrides), f"--set (over {source})")
    return validate_params(raw, source)


def run_dir(params: dict[str, Any]) -> Path:
    """``<output_root>/<run_name>`` (relative output roots are resolved against the repo root)."""
    root = Path(params.get("output_root") or "outputs")
    if not root.is_absolute():
        root = REPO_ROOT / root
    return root / params["run_name"]
