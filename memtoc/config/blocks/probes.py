"""The ``probes`` block (notebook 05): the default run's small slice (params/default.yaml: measured
cost; params/probes.yaml: the documented full sizes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from memtoc.config.blocks.base import Block, Fail, as_list, is_num
from memtoc.core.vocab import BAND, BUILTIN, DIRECTIONS, FVU_GATE, MINING_SETS, POSITIONS, STEER_BARS
from memtoc.generation.models import ModelError, get_model

PER_MODEL = ("bands", "lens_files", "sae_layers", "sae_files", "arms")   # mappings keyed by model name
PROBE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ProbesConfig(Block):
    """Every key of the ``probes`` block with its default."""
    BLOCK = "probes"
    SEE = "params/probes.yaml"

    enabled: bool = True
    models: Optional[tuple[str, ...]] = None       # None: every run model; else a list of the run's models
    dtype: str = "float32"                         # the probed models' weights and read-outs: float32, or bfloat16
                                                   # (half the memory: an 8-9B model on a 40 GB GPU); the lens fit
                                                   # needs float32, so under bfloat16 every model needs a lens_files entry
    corpus: str = BUILTIN                          # builtin (pydoc_data.topics) or a UTF-8 text file
    # Jacobian lens
    bands: dict = field(default_factory=dict)      # {model: [lo, hi]} inclusive source layers; default: the top
                                                   # default_band_layers
    default_band_layers: int = 4
    lens_files: dict = field(default_factory=dict)  # {model: path | URL | hf://owner/repo/path | {url, sha256}}; else fitted
    lens_fit_prompts: int = 1                      # fit-corpus documents (exact estimator; cost: params/probes.yaml)
    lens_max_seq_len: int = 24
    lens_skip_first: int = 4                       # transformer-lens's default is 16 with 128-token prompts
    lens_dim_batch: int = 128
    heldout_texts: int = 2                         # lens quality and spliced loss: held-out corpus documents
    heldout_max_seq_len: int = 32
    lens_formulations: tuple[str, ...] = ("reference",)
    lens_max_episodes: int = 6                     # per set and split (the paper: all of its arbitration episodes)
    n_control: int = 5                             # other questions' answers per prompt
    # SAE
    sae_layers: dict = field(default_factory=dict)  # {model: [layers]}; default: the band's middle layer
    sae_files: dict = field(default_factory=dict)   # {model: {layer: dir | URL | hf://owner/repo[@rev]/folder}}
                                                   # ReLU/JumpReLU/TopK (sae-lens, GemmaScope, Llama Scope layouts)
    dictionaries: dict = field(default_factory=dict)   # {model: {release, sae_id, layer}} the paper's public
                                                   # dictionaries (recorded; used when a local copy is named in
                                                   # sae_files, else one is trained)
    sae_expansion: int = 4
    sae_k: int = 16
    sae_steps: int = 150
    sae_batch: int = 256
    sae_lr: float = 1.0e-3
    sae_prompts: int = 8                           # run episode prompts (full sequences) for training
    sae_corpus_texts: int = 2                      # plus generic documents
    sae_max_seq_len: int = 128
    sae_heldout_prompts: int = 3                   # held-out episode prompts: FVU gate, spliced loss
    fvu_gate: float = FVU_GATE
    # mining and steering
    mine_fold: int = 0
    mining_set: str = "fold"                       # fold | dpo_pairs (App. C: the tool-wrong episodes under 04's
                                                   # DPO pairs of fold mine_fold)
    mine_per_label: int = 6                        # mining episodes per label (kept memory / followed tool)
    top_features: int = 8                          # latents per side, in descending MI order
    feature_mi_share: float | None = None          # else App. C's K: per side, the fewest latents holding this
                                                   # share of the side's MI (the paper: 0.5, widened to 0.7)
    steer_per_direction: int = 2                   # the paper: 40 per direction
    strengths: tuple[float, ...] = (12,)           # the paper: 1-12
    directions: tuple[str, ...] = DIRECTIONS
    positions: tuple[str, ...] = POSITIONS
    steer_formulations: tuple[str, ...] = ("reference",)
    arms: dict = field(default_factory=dict)       # {model: [{layers: [l, ...] | band, position}]}: App. C's
                                                   # multi-layer arms, the edit at every layer at once
    steer_bar: str = "dev_flip"                    # dev_flip (App. C: half the prompting effect on the steered
                                                   # episodes' own flip) | pooled (half 03's pooled effect)

    @classmethod
    def check(cls, pr: dict[str, Any], run: Mapping[str, Any], fail: Fail, **context: Any) -> None:
        for key, valid in (("directions", DIRECTIONS), ("positions", POSITIONS)):
            bad = [v for v in pr[key] if v not in valid] if isinstance(pr[key], list) else [pr[key]]
            if bad:
                fail(key, f"unknown value(s) {bad}; valid: {', '.join(valid)}")
        if not isinstance(pr["strengths"], list) or not pr["strengths"] \
                or any(not is_num(s) or s <= 0 for s in pr["strengths"]):
            fail("strengths", f"must be a list of positive numbers (0 is the baseline, always run), got {pr['strengths']!r}")
        share = pr["feature_mi_share"]
        if share is not None and (not is_num(share) or not 0 < share <= 1):
            fail("feature_mi_share", f"must be a number in (0, 1] (App. C: 0.5) or null for top_features, got {share!r}")
        for key in PER_MODEL:
            if not isinstance(pr[key], dict):
                fail(key, f"must be a mapping keyed by model name, got {pr[key]!r}")
        run_models = list(run["models"])
        pr["models"] = run_models if pr["models"] is None else as_list(pr["models"])
        if not isinstance(pr["models"], list) or not pr["models"] or any(m not in run_models for m in pr["models"]):
            fail("models", f"must be null (every run model) or a non-empty list drawn from the run's models "
                           f"{run_models}, got {pr['models']!r}")
        if pr["dtype"] not in PROBE_DTYPES:
            fail("dtype", f"must be one of {', '.join(PROBE_DTYPES)}, got {pr['dtype']!r}")
        if pr["dtype"] == "bfloat16" and pr["enabled"]:
            unfitted = [m for m in pr["models"] if not _lens_named(pr["lens_files"], m)]
            if unfitted:
                fail("dtype", f"bfloat16 needs a lens for every probed model (the lens fit's backward passes need "
                              f"float32), and {unfitted} have none: name one in probes.lens_files (published, a "
                              "path or a URL), leave those models out of probes.models, or use float32")
        for key, valid in (("mining_set", MINING_SETS), ("steer_bar", STEER_BARS)):
            if pr[key] not in valid:
                fail(key, f"unknown value {pr[key]!r}; valid: {', '.join(valid)}")
        for model, arms in pr["arms"].items():
            if not isinstance(arms, list):
                fail(f"arms.{model}", f"must be a list of {{layers, position}} arms, got {arms!r}")
            for i, arm in enumerate(arms):
                cls.check_arm(arm, f"arms.{model}[{i}]", fail)

    @staticmethod
    def check_arm(arm: Any, where: str, fail: Fail) -> None:
        if not isinstance(arm, dict) or set(arm) - {"layers", "position"} or "layers" not in arm:
            fail(where, f"must be a mapping {{layers: [l, ...] or {BAND}, position: last | tool_span}}, got {arm!r}")
        layers = arm["layers"]
        if layers != BAND and (not isinstance(layers, list) or not layers
                               or any(not isinstance(l, int) or isinstance(l, bool) or l < 0 for l in layers)
                               or len(set(layers)) != len(layers)):
            fail(f"{where}.layers", f"must be {BAND!r} or a list of distinct layer numbers, got {layers!r}")
        if arm.get("position", "last") not in POSITIONS:
            fail(f"{where}.position", f"unknown position {arm.get('position')!r}; valid: {', '.join(POSITIONS)}")


def model_entry(table: Mapping[str, Any], name: str, label: Optional[str] = None) -> Any:
    """A per-model entry of the probes block (:data:`PER_MODEL`, ``dictionaries``): the one keyed by the
    model's registry name, else by its label, else None."""
    for key in (name, label):
        if key is not None and key in table:
            return table[key]
    return None


def _lens_named(lens_files: dict, model: str) -> bool:
    """Whether ``probes.lens_files`` names a lens for ``model`` (by registry name or label)."""
    try:
        label = get_model(model).label
    except ModelError:
        label = None
    return bool(model_entry(lens_files, model, label))
