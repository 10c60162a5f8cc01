"""The typed run configuration: built once from the params file, read by every stage.

    cfg = RunConfig.load("params/default.yaml")          # or RunConfig.of(P) for a params dict
    cfg.models, cfg.n_boot, cfg.judge.model, cfg.paths.summary("evaluation")

``RunConfig`` holds every parameter of ``memtoc.config.params.DEFAULTS`` as a typed attribute (validated by
``config.validate_params``: errors name the file, the field and the fix; every existing params file
is accepted); the stage blocks are typed and resolved once (``memtoc.config.blocks``:
``cfg.finetune.max_steps``, ``cfg.transfer.frames``, ``cfg.probes.sae_k``, ``cfg.agent.protocols``,
``cfg.judge.model``), plus ``run_dir`` and ``paths`` (:class:`RunPaths`, the ``outputs/<run>/`` layout that
writers and readers share). It also reads like the flat parameter dict the notebooks used to pass
around (``cfg["models"]``, ``cfg.get("seed")``, ``{**cfg}``): that view is the validated params
file (``cfg["finetune"]`` is the block as written there, merged over ``{enabled: true}``), which is
what ``config.json`` records and hashes per stage.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import yaml

from memtoc.config.blocks import AgentConfig, FinetuneConfig, JudgeConfig, ProbesConfig, TransferConfig, resolve_blocks
from memtoc.config.params import DEFAULTS, load_params, resolve_release_dir, run_dir, validate_params
from memtoc.core.errors import ConfigError
from memtoc.core.io import atomic_write_text, plain, write_json
from memtoc.core.vocab import Backend, ClosedBookVariant, Formulation, Matcher

#: the advisory lock file of a run directory (``memtoc.run.lock``)
LOCK_NAME = ".memtoc.lock"


@dataclass(frozen=True)
class RunPaths:
    """The ``outputs/<run>/`` layout (docs/architecture.md, "Output layout"): every file and folder of
    a run is named here, and every stage writes and reads through these names. ``root`` may be given as
    a string; it is kept as a :class:`~pathlib.Path`."""
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # -- the run's bookkeeping -----------------------------------------------------------------
    @property
    def config_json(self) -> Path:
        return self.root / "config.json"

    @property
    def params_yaml(self) -> Path:
        return self.root / "params.yaml"

    @property
    def lock_file(self) -> Path:
        """``.memtoc.lock``: who runs on this directory now (``memtoc.run.lock``)."""
        return self.root / LOCK_NAME

    @property
    def progress_file(self) -> Path:
        """The running notebook's progress lines (``memtoc.core.progress``), read by ``memtoc run``."""
        return self.root / ".progress.json"

    @property
    def notebooks(self) -> Path:
        """``notebooks/``: the executed copies."""
        return self.root / "notebooks"

    def notebook(self, name: str) -> Path:
        return self.notebooks / name

    # -- summaries, figures, the paper ---------------------------------------------------------
    @property
    def summaries(self) -> Path:
        return self.root / "summaries"

    @property
    def figures(self) -> Path:
        return self.root / "figures"

    @property
    def paper(self) -> Path:
        return self.root / "paper"

    @property
    def report_md(self) -> Path:
        """``paper/report.md``."""
        return self.paper / "report.md"

    @property
    def claims_json(self) -> Path:
        """``paper/claims.json``."""
        return self.paper / "claims.json"

    def summary(self, stage: str) -> Path:
        """``summaries/<stage>.json``."""
        return self.summaries / f"{stage}.json"

    def write_summary(self, stage: str, summary: Mapping[str, Any]) -> Path:
        """Write ``summaries/<stage>.json`` atomically (JSON-safe values, ``io.plain``: NaN is null);
        every stage's summary goes through here, so they share one format."""
        return write_json(self.summary(stage), summary)

    def write_params(self, params: Mapping[str, Any], written_by: str) -> Path:
        """Write ``params.yaml`` (the resolved parameters every notebook reads) atomically, under a
        comment naming ``written_by``; ``memtoc run``, papermill runs and ``memtoc merge`` all go here."""
        return atomic_write_text(self.params_yaml, f"# Resolved parameters of this run, written by {written_by}\n"
                                 + yaml.safe_dump(plain(params), sort_keys=False, allow_unicode=True))

    def figure(self, name: str) -> Path:
        """``figures/<name>.png``."""
        return self.figures / f"{name}.png"

    # -- episodes, generations, scored rows ----------------------------------------------------
    def episodes(self, formulation: str) -> Path:
        """``episodes/<formulation>.jsonl``."""
        return self.root / "episodes" / f"{formulation}.jsonl"

    def generations(self, model_label: str) -> Path:
        """``generations/<model>/``: the generation cache files of one model (or of a judge,
        ``judge__<judge>``)."""
        return self.root / "generations" / model_label

    def generation_file(self, model_label: str, stem: str) -> Path:
        """``generations/<model>/<stem>.jsonl``: one cache file."""
        return self.generations(model_label) / f"{stem}.jsonl"

    def scored_dir(self, folder: str = "scored") -> Path:
        """``scored/`` (``folder="scored_judged"``: the judged layer)."""
        return self.root / folder

    def scored(self, model_label: str, folder: str = "scored") -> Path:
        """``scored/<model>/`` (``folder="scored_judged"``: the judged layer)."""
        return self.scored_dir(folder) / model_label

    def scored_file(self, model_label: str, key: str, folder: str = "scored") -> Path:
        """``scored/<model>/<arm_key>.jsonl``."""
        return self.scored(model_label, folder) / f"{key}.jsonl"

    def closed_book(self, model_label: str, variant: str) -> Path:
        """``scored/<model>/closed_book_<variant>.jsonl``: notebook 02's memory status."""
        return self.scored_file(model_label, f"closed_book_{variant}")

    # -- adapters (04, 06) ---------------------------------------------------------------------
    def adapters(self, model_label: str) -> Path:
        """``adapters/<model>/``."""
        return self.root / "adapters" / model_label

    def adapter(self, model_label: str, objective: str, fold: Union[int, str]) -> Path:
        """``adapters/<model>/<objective>/fold<k>/``."""
        return self.adapters(model_label) / objective / f"fold{fold}"

    def full_pool_adapter(self, model_label: str, objective: str) -> Path:
        """``adapters/<model>/<objective>/full/``: a forward-transfer adapter trained on the whole pool (06)."""
        return self.adapters(model_label) / objective / "full"

    def external_adapter(self, model_label: str, objective: str) -> Path:
        """``adapters/<model>/<objective>/external/``: the reverse-transfer adapter (06)."""
        return self.adapters(model_label) / objective / "external"

    def untreated_closed_book(self, model_label: str, variant: str) -> Path:
        """``adapters/<model>/untreated_closed_book_<variant>.jsonl``: 04's untreated closed-book rows."""
        return self.adapters(model_label) / f"untreated_closed_book_{variant}.jsonl"

    # -- probes (05) ---------------------------------------------------------------------------
    def probes(self, model_label: str) -> Path:
        """``probes/<model>/``."""
        return self.root / "probes" / model_label

    def probe_lens(self, model_label: str, key: str) -> Path:
        """``probes/<model>/lens/<fit key>/``: a fitted Jacobian lens."""
        return self.probes(model_label) / "lens" / key

    def probe_sae(self, model_label: str, layer: int) -> Path:
        """``probes/<model>/sae/layer<l>/``: a trained sparse autoencoder."""
        return self.probes(model_label) / "sae" / f"layer{layer}"

    def probe_steer_cache(self, model_label: str) -> Path:
        """``probes/<model>/steer/replies.jsonl``: the steered replies (cache)."""
        return self.probes(model_label) / "steer" / "replies.jsonl"

    # -- transfer (06) -------------------------------------------------------------------------
    def transfer_scored(self, model_label: str, arm: str) -> Path:
        """``transfer/<model>/scored_<arm>.jsonl``."""
        return self.root / "transfer" / model_label / f"scored_{arm}.jsonl"

    # -- the agent loop (07) -------------------------------------------------------------------
    def agent(self, model_label: str) -> Path:
        """``agent/<model>/``."""
        return self.root / "agent" / model_label

    def agent_traces(self, model_label: str) -> Path:
        """``agent/<model>/traces.jsonl``: 07's events (resumable)."""
        return self.agent(model_label) / "traces.jsonl"

    def agent_cache(self, model_label: str) -> Path:
        """``agent/<model>/cache/``: the agent's replies."""
        return self.agent(model_label) / "cache"

    def agent_closed_book(self, model_label: str, variant: str = "forced") -> Path:
        """``agent/<model>/closed_book_<variant>.jsonl``: the agent questions' closed-book rows."""
        return self.agent(model_label) / f"closed_book_{variant}.jsonl"

    def agent_arm_traces(self, model_label: str, arm: str) -> Path:
        """``agent/<model>/arms/<arm>/traces.jsonl``: an extra arm's events (an adapter, a sampling seed)."""
        return self.agent(model_label) / "arms" / arm / "traces.jsonl"


@dataclass(frozen=True)
class RunConfig(Mapping):
    run_name: str
    output_root: str
    release_dir: Optional[str]
    seed: int
    models: tuple[str, ...]
    backend: Backend
    backend_options: dict
    batch_size: Union[int, str]
    dtype: str
    max_new_tokens: int
    model_cache_dir: Optional[str]
    formulations: tuple[Formulation, ...]
    base_formulations: Optional[tuple[Formulation, ...]]   # base models' formulations (None: all)
    n_questions: int
    n_questions_extra: int
    closed_book_variant: ClosedBookVariant
    elicit_permissive: bool
    extra_arms: tuple[str, ...]
    matcher: Matcher
    n_boot: int
    n_perm: int
    alpha: float
    finetune: FinetuneConfig
    transfer: TransferConfig
    probes: ProbesConfig
    agent: AgentConfig
    judge: Optional[JudgeConfig]
    verify: bool
    run_dir: Path                       # <output_root>/<run_name>, resolved
    source: str = "<params>"            # the params file (for error messages)
    # parameters of config.DEFAULTS without a typed field yet (a stage added its block): readable as
    # cfg[key] / cfg.key; tests/unit/test_runconfig.py asks for a typed field
    untyped: dict = field(default_factory=dict)
    # the stage blocks as the params file gives them (the mapping view and config.json read these)
    blocks: dict = field(default_factory=dict, repr=False)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Union[str, os.PathLike, None] = None, overrides: Optional[dict] = None) -> "RunConfig":
        """Read and validate a params YAML (``None``: the defaults), like ``config.load_params``."""
        return cls._build(load_params(path, overrides), str(path) if path is not None else "<defaults>")

    @classmethod
    def of(cls, params: Union["RunConfig", Mapping[str, Any]], source: str = "<params>") -> "RunConfig":
        """``params`` itself when it is a RunConfig; else a flat parameter mapping (``run_dir`` may
        be among its keys) validated over the defaults."""
        if isinstance(params, RunConfig):
            return params
        raw = dict(params)
        rd = raw.pop("run_dir", None)
        return cls._build(validate_params(raw, source), source, rd)

    @classmethod
    def _build(cls, p: dict[str, Any], source: str, rd: Any = None) -> "RunConfig":
        j = p["judge"]
        typed = _typed_fields()
        kw = {k: p[k] for k in DEFAULTS if k in typed}
        kw.update(models=tuple(p["models"]), formulations=tuple(p["formulations"]),
                  base_formulations=None if p["base_formulations"] is None else tuple(p["base_formulations"]),
                  extra_arms=tuple(p["extra_arms"]),
                  judge=None if j is None else JudgeConfig(**j), **resolve_blocks(p, source))
        untyped = {k: p[k] for k in DEFAULTS if k not in typed}
        blocks = {k: p[k] for k in ("finetune", "transfer", "probes", "agent")}
        return cls(**kw, run_dir=Path(rd) if rd is not None else run_dir(p), source=source, untyped=untyped,
                   blocks=blocks)

    def with_release_resolved(self) -> "RunConfig":
        """A copy whose ``release_dir`` is the absolute release folder (``config.resolve_release_dir``)."""
        return self.replace(release_dir=str(resolve_release_dir(self.release_dir)))

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with ``changes`` applied and validated again."""
        d = {**self.as_params(), **changes}
        return RunConfig.of(d, self.source)

    # -- views ---------------------------------------------------------------------------------
    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.run_dir)

    @property
    def closed_book_variants(self) -> list[str]:
        """The primary closed-book variant first, then the permissive one when it is elicited too."""
        out = [self.closed_book_variant]
        if self.elicit_permissive:
            out += [v for v in ("forced", "permissive") if v not in out]
        return out

    def generator_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``models.load_generator`` for the run's models."""
        return dict(backend=self.backend, batch_size=self.batch_size, dtype=self.dtype,
                    max_new_tokens=self.max_new_tokens, model_cache_dir=self.model_cache_dir,
                    **(self.backend_options or {}))

    def as_params(self, with_run_dir: bool = True) -> dict[str, Any]:
        """The flat parameter dict (lists, the judge block as a mapping), equal to what
        ``config.load_params`` gives for the same file, plus ``run_dir`` unless ``with_run_dir`` is
        False (the form written to ``params.yaml`` and ``config.json`` and hashed per stage)."""
        out = {k: self[k] for k in DEFAULTS}
        if with_run_dir:
            out["run_dir"] = self.run_dir
        return out

    # -- the Mapping protocol: a RunConfig reads like the old flat dict -------------------------
    def __getattr__(self, name: str) -> Any:       # only for names that are not fields
        untyped = self.__dict__.get("untyped") or {}
        if name in untyped:
            return untyped[name]
        raise AttributeError(f"'RunConfig' object has no attribute {name!r}")

    def __getitem__(self, key: str) -> Any:
        if key not in _keys():
            raise KeyError(key)
        if key in self.blocks:
            return self.blocks[key]
        v = getattr(self, key)
        if isinstance(v, tuple):
            return list(v)
        if isinstance(v, JudgeConfig):
            return v.to_dict()
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(_keys())

    def __len__(self) -> int:
        return len(_keys())


def expect_config(cfg: Any, where: str) -> RunConfig:
    """``cfg`` when it is a RunConfig; a TypeError naming ``where`` otherwise. Stage entry points take
    the typed configuration only: a params dict is turned into one at the edge (``RunConfig.load``,
    ``RunConfig.of``), once."""
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"{where} takes a RunConfig (RunConfig.load(path) or RunConfig.of(params)), "
                        f"not a {type(cfg).__name__}")
    return cfg


def _keys() -> tuple[str, ...]:
    return tuple(DEFAULTS) + ("run_dir",)


def _typed_fields() -> set[str]:
    return {f.name for f in fields(RunConfig)} - {"run_dir", "source", "untyped", "blocks"}


__all__ = ["RunConfig", "expect_config", "RunPaths", "AgentConfig", "FinetuneConfig", "JudgeConfig", "ProbesConfig", "TransferConfig",
           "ConfigError"]
