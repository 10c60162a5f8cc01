"""Notebook 05's probes (paper App. H and App. C): the Jacobian-lens availability probe and the SAE
steering probe. ``corpus`` (the offline fit text), ``hfmodel`` (the HF model's layers, unembedding
and hooks), ``lens`` (Jacobian / logit lens: fit, artifacts, read-outs, quality), ``sae`` (TopK SAE:
trainer, metrics, sae-lens files), ``dictionaries`` (ReLU / JumpReLU / TopK readers), ``lensfiles``
(published lenses by path, URL or hf:// name), ``mining`` (MI feature mining, fold-disjoint sets), ``steering``
(SpARE-style clamped edits, steered replies, cells), ``core`` (the stage), ``plots`` (figures).
"""
from __future__ import annotations

from memtoc.stages.probes.core import SETS, SPLITS, ProbeError, caveat, episode_sets, run
from memtoc.stages.probes.plots import lens_table, plot_lens, plot_steering, sae_table, steer_table

__all__ = ["SETS", "SPLITS", "ProbeError", "caveat", "episode_sets", "run",
           "plot_lens", "plot_steering", "lens_table", "steer_table", "sae_table"]
