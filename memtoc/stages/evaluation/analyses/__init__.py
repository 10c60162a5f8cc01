"""The analyses of notebook 03: scored frames in, JSON-ready dicts out (``summaries/evaluation.json``).

Pure functions over the scored frames of :func:`memtoc.stages.evaluation.evaluate` (one or more models),
one concern per module: :mod:`.subsets` (the episodes an analysis reads), :mod:`.headline` (the
headline block, cells, source matrix, matcher sensitivity), :mod:`.arms` (the section of every
extra arm), :mod:`.closed_book` (App. D), :mod:`.cross_model` (ranking stability, App. E) and
:mod:`.summary` (:func:`model_summary`, the Holm families, :func:`evaluation_summary`,
:func:`write_summary`). Rates with intervals and paired contrasts come from :mod:`memtoc.core.intervals`
(``rate_intervals``, ``contrast``, ``apply_holm``, ``add_rates``, ``interval_obj``), the Holm
families from :mod:`memtoc.core.stats` (``FAMILIES``, ``apply_families``, ``apply_finetune_families``);
they are re-exported here under their old names.

``summaries/evaluation.json`` — structure (stable; claims cite it by JSON pointer)
-----------------------------------------------------------------------------------
An *interval object* is ``{"value": float|null, "ci95": [lo, hi]|null, "n": int}`` (rates in [0, 1];
``n`` = the denominator in episodes; ``value`` null when ``n`` is 0; pooled headline entries add
``n_formulations``; pooled intervals add ``n_boot_used``, the bootstrap replicates in which every
formulation drew a unit: the interval rests on those). A *contrast object* is ``{"delta", "ci95",
"p", "p_holm", "family", "n_units", "n_clusters", "n_treated_only", "n_untreated_only",
"treatment", "baseline"}``: the paired difference treatment − baseline on common support, units
(formulation, qkey) clustered by qkey, question-cluster bootstrap CI and sign-flip permutation p
(``stats.paired_contrast``), ``p_holm`` Holm-adjusted within the paper's family
(``stats.FAMILIES``, listed under ``/holm_families``; null for the diagnostics, which the paper
leaves uncorrected), ``n_treated_only`` / ``n_untreated_only`` the units outside the common support. ``<form>`` is a formulation (reference, paraphrase_a,
paraphrase_b) or ``pooled`` = the unweighted mean over formulations (the paper's pooling; CI from
question clusters resampled jointly across formulations). ::

    /schema_version                                  1
    /run_name /matcher /n_boot /n_perm /alpha /seed /formulations
    /metrics/<metric>                                one-line definition of every metric named here
    /models/<model>/n_questions                      {"headline": int, "extra": int}
    /models/<model>/n_episodes                       int
    /models/<model>/headline/<form>/<metric>         interval object, from metrics.summarize_group on
                                                     the untreated arm, schema frame, default error
                                                     payload: retention, tool_follow, wrong_follow,
                                                     err_abstain (the four headline metrics), cra_arb,
                                                     cra_conflict, agree_acc, nc_acc, keep_flag, bw_gold
    /models/<model>/headline/<form>/n_<cell>         int cell sizes: n_arb, n_tool_gold, n_both_wrong,
                                                     n_agree, n_mem_absent, n_err, n_both_in_arb
                                                     (+ /headline/pooled/n_questions)
    /models/<model>/cells/<form>/<cell>              int: tool_wrong episodes per cell (agree, arb,
                                                     tool_gold, both_wrong, mem_absent)
    /models/<model>/source_matrix/<form>/<cell>      {"n", "follow_rate", "keep_rate", "correct_rate"}
                                                     for agree / arb / tool_gold / both_wrong (tool_right
                                                     + tool_wrong episodes; pooled sums episodes)
    /models/<model>/prompting/n_questions            int (the extra-arm questions)
    /models/<model>/prompting/untreated/<form>/<metric>   interval object on the same questions
    /models/<model>/prompting/<arm>/<form>/<metric>  interval object; arms warn, prior, flag; metrics
                                                     retention, tool_follow, wrong_follow, err_abstain
    /models/<model>/prompting/<arm>/contrasts/<metric>    contrast object vs untreated (pooled slice);
                                                     retention in prompting_retention, tool_follow in
                                                     prompting_tool_follow (instruction-tuned models ×
                                                     strategies), the other metrics uncorrected
    /models/<model>/prompting/<arm>/contrasts_by_formulation/<form>/<metric>   the same contrast on
                                                     one formulation (the families' other slices)
    /models/<model>/prompting/<arm>/success          stats.success_criterion: {"passed": bool,
                                                     "retention_up", "tool_drop", "retention_delta",
                                                     "retention_p", "tool_delta", "tool_p", "alpha",
                                                     "reason"} (retention up significantly after Holm
                                                     and no significant drop in tool_follow after Holm)
    /models/<model>/protocol/...                     the no_protocol_sentence ablation, laid out like
                                                     prompting (arm no_protocol_sentence, no success)
    /models/<model>/frames/n_questions               int
    /models/<model>/frames/<frame>/<form>/<metric>   interval object; frames schema (baseline on the
                                                     same questions), no_schema, passage; metrics
                                                     correct_value_follow (tool_right, all episodes),
                                                     incorrect_value_follow (tool_wrong, all episodes),
                                                     retention, tool_follow, wrong_follow (cell-restricted)
    /models/<model>/frames/<frame>/contrasts/<metric>     contrast vs schema (retention too); retention
                                                     in frames_retention (models × frames)
    /models/<model>/frames/<frame>/contrasts_by_formulation/<form>/<metric>   per formulation
    /models/<model>/far/n_common                     int: questions with both a far and a near episode
    /models/<model>/far/<near|far>/<form>/<metric>   interval object: retention, wrong_follow,
                                                     incorrect_value_follow on the common support
    /models/<model>/far/contrasts/<metric>           contrast far − near, pooled (uncorrected)
    /models/<model>/payloads/n_questions             int
    /models/<model>/payloads/<kind>/<form>/err_abstain    interval object; kinds service_unavailable
                                                     (the paper's), timeout, permission_denied
    /models/<model>/payloads/contrasts/<kind>        contrast of err_abstain vs service_unavailable;
                                                     family = the two other kinds
    /models/<model>/noop/n_questions                 int
    /models/<model>/noop/<noop|no_tool>/<form>/<metric>   interval object: accuracy (final_correct),
                                                     abstain, over all episodes of the condition
    /models/<model>/noop/contrasts/<metric>          contrast noop − no_tool; family {accuracy, abstain}
    /models/<model>/matcher_sensitivity/<form>/<metric>   {"paper", "strict", "delta"} point values of
                                                     retention, tool_follow, wrong_follow, err_abstain,
                                                     cra_conflict after re-scoring the same replies
                                                     (and closed-book answers) with matcher="strict";
                                                     delta = strict − paper
    /models/<model>/matcher_sensitivity/changed_decisions/<field>   share of headline episodes whose
                                                     followed_tool / kept_memory / final_correct / cell
                                                     changes
    /models/<model>/formulation_spread/<metric>      max − min of the headline rate over formulations
                                                     (metrics.formulation_spread; the paper's §5.3)
    /models/<model>/far/contrasts_reference/<metric> far − near on the Reference formulation alone;
                                                     retention in far_retention (every model)
    /models/<model>/protocol/no_protocol_sentence/contrasts_reference/<metric>   likewise
    /models/<model>/closed_book                      {"final_line_with_tool": {"n", "rate"},
                                                     "final_line_closed_book", "forced_vs_permissive":
                                                     {<form>|pooled: {"n", "both_answered",
                                                     "same_correctness", "permissive_abstained"}}} (App. D)
    /holm_families/<family>                          every evaluation family of stats.FAMILIES:
                                                     {"metric", "axes", "models", "slices", "test",
                                                     "description", "members": {slice: {member:
                                                     p_holm}}} (slices without members left out)
    /ranking_stability/<metric>                      stats.ranking_stability over the models, for the
                                                     four headline metrics: {"rule", "orders":
                                                     {"pooled": [...], <form>: [...]},
                                                     "full_order_stable" (the paper's rule: the full
                                                     ordering everywhere), "reference_order" (with a
                                                     base model, Reference only), "pairwise_note",
                                                     "pairs", "stable_pairs" (a weaker pairwise reading)}
    /cross_model/<metric>                            {"formulation": "reference", "all_pairs": {"a|b":
                                                     two-proportion z-test + p_holm}, "base_vs_instruct":
                                                     {"base|instruct": z-test}} (App. E; retention and
                                                     wrong_follow; families cross_model_ztest_<metric>,
                                                     base_vs_instruct_ztest_<metric>)
    /cross_model/retention/base_vs_instruct_paired/<base|instruct>   contrast object base − instruct,
                                                     paired by question on the Reference formulation,
                                                     family base_vs_instruct_paired_retention (App. E C)

Sections whose episodes are absent from the run (an extra arm turned off) are omitted.
"""
from __future__ import annotations

from memtoc.core.intervals import add_rates, apply_holm, contrast, interval_obj, rate_intervals
from memtoc.core.stats import apply_finetune_families
from memtoc.stages.evaluation.analyses.arms import (
    add_reference_contrasts,
    add_success,
    arm_comparison,
    far_comparison,
    frames_comparison,
    noop_comparison,
    payload_comparison,
)
from memtoc.stages.evaluation.analyses.closed_book import (
    closed_book_agreement,
    closed_book_section,
    final_line_compliance,
)
from memtoc.stages.evaluation.analyses.cross_model import (
    base_models,
    cross_model_families,
    cross_model_section,
    paired_base_vs_instruct,
    ranking_section,
)
from memtoc.stages.evaluation.analyses.headline import (
    cell_counts,
    headline_metrics,
    matcher_sensitivity,
    point_metrics,
    source_matrix,
)
from memtoc.stages.evaluation.analyses.subsets import present_formulations, restrict_questions, select_arm
from memtoc.stages.evaluation.analyses.summary import (
    SCHEMA_VERSION,
    apply_families,
    evaluation_summary,
    model_summary,
    write_summary,
)

__all__ = [
    "SCHEMA_VERSION", "add_rates", "add_reference_contrasts", "add_success", "apply_families",
    "apply_finetune_families", "apply_holm", "arm_comparison", "base_models", "cell_counts",
    "closed_book_agreement", "closed_book_section", "contrast", "cross_model_families", "cross_model_section",
    "evaluation_summary", "far_comparison", "final_line_compliance", "frames_comparison", "headline_metrics",
    "interval_obj", "matcher_sensitivity", "model_summary", "noop_comparison", "paired_base_vs_instruct",
    "payload_comparison", "point_metrics", "present_formulations", "rate_intervals", "ranking_section",
    "restrict_questions", "select_arm", "source_matrix", "write_summary",
]
