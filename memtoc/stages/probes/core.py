"""Notebook 05's stage: the Jacobian-lens availability probe (App. H, Table 8) and the SAE steering
probe (App. C) on every model of the run, reading notebooks 02/03's outputs of the same run.

``summaries/probes.json`` (``schema_version`` 1)::

    /corpus, /caveat, /config
    /models/<model>/lens/<set>/<readout>/{followed_tool,kept_memory,control}   {median_rank, top20, n}
    /models/<model>/lens/<set>/<readout>/best_subtoken/<split>                  same, best rank over subtokens
    /models/<model>/lens/<set>/<readout>/answer_not_in_prompt/<split>           same, answers absent from the prompt
    /models/<model>/lens/<set>/<readout>/per_layer/<split>                      {layer: median rank}
    /models/<model>/lens/<set>/n_episodes, n_both, n_neither
    /models/<model>/lens_quality/<readout>/<layer>                              {top1, n}
    /models/<model>/lens_fit                                                    band, file, corpus, prompts, tokens, seconds
    /models/<model>/sae/layers/<l>/{fvu, passes_gate, l0, dead_fraction, spliced_loss, file, ...}
    /models/<model>/sae/split                                                   mining set (probes.mining_set) and edit set
    /models/<model>/sae/mining                                                  features per side and layer
    /models/<model>/sae/arms/<arm>                                              a multi-layer arm: layers, position, median FVU gate
    /models/<model>/sae/steer/bar                                               the stopping bar (probes.steer_bar: pooled | dev_flip)
    /models/<model>/sae/steer/<layer>/<direction>/<position>/<strength>         steering cell (steering.cell)
    /models/<model>/sae/steer/arms/<arm>/<direction>/<position>/<strength>      a multi-layer arm's cell (saerun)
    /models/<model>/timing                                                      seconds per part
    /published                                                                  the paper's Table 8 and App. C numbers

Sets: ``arbitration`` (the paper's: tool_wrong episodes in the arbitration cell, closed-book answer
correct) and ``own_answer`` (every tool_wrong episode whose closed-book answer is non-empty and
differs from the tool value). Splits by the untreated reply: ``followed_tool`` / ``kept_memory``;
``control`` = the same prompts' ranks of other questions' closed-book answers.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from memtoc.config.blocks import ProbesConfig, model_entry
from memtoc.config.params import resolve_release_dir
from memtoc.config.runconfig import RunConfig, RunPaths, expect_config
from memtoc.core.errors import ConfigError, MemtocError
from memtoc.core.records import arm_key
from memtoc.core.scoring import canon, strip_answer_label
from memtoc.core.vocab import PUBLISHED_LENS
from memtoc.data.benchmark import load_benchmark
from memtoc.generation import models
from memtoc.generation.weights import model_cache_root
from memtoc.stages.probes import corpus as C, lens as L, lensfiles as LF, saerun as SR
from memtoc.stages.probes.hfmodel import LoadedModel, load_model

SCHEMA_VERSION = 1
SETS = ("arbitration", "own_answer")
SPLITS = ("followed_tool", "kept_memory")
TOP = 20

TINY_CAVEAT = ("{label}: an embedded tiny model ({params} parameters) whose arbitration cell holds a handful of "
               "episodes, {lens}, and {sae}: pipeline checks, not measurements of the paper's models. No "
               "mechanism claims.")
MODEL_CAVEAT = ("{label} ({hub}): {lens}; {sae}. Table 8's ranks compare with the paper's only under its published "
                "lens and source-layer band; App. C was measured on the previous benchmark version (App. B). No "
                "mechanism claims.")


def caveat(spec: models.ModelSpec, lens_fit: dict, sae_used: dict) -> str:
    """The caveat of one model's probe numbers: what the model is (an embedded tiny model or a model
    of the registry), where its lens came from (``lens_fit``: run_lens's record) and its dictionaries
    (``sae_used``: {layer: "given" | "trained here"})."""
    if lens_fit.get("source") == "given":
        lens = f"a given Jacobian lens ({lens_fit.get('url') or lens_fit.get('file')}, sha256 {lens_fit.get('sha256', '?')[:12]})"
    else:
        corpus = (lens_fit.get("corpus") or {}).get("name", "?")
        lens = (f"a Jacobian lens fitted here on {lens_fit.get('n_prompts', '?')} document(s) of the offline corpus "
                f"{corpus} (the published lenses: wikitext)")
    kinds = sorted(set(sae_used.values()))
    sae = ("no SAE" if not kinds else "SAE dictionaries " + " / ".join(
        "trained here on a few thousand tokens" if k == "trained here" else "given (released)" for k in kinds))
    if spec.source == "embedded":
        return TINY_CAVEAT.format(label=spec.label, params=f"{spec.params_b * 1000:.0f}M" if spec.params_b else "?",
                                  lens=lens, sae=sae)
    return MODEL_CAVEAT.format(label=spec.label, hub=spec.hub_id or spec.path or spec.name, lens=lens, sae=sae)


class ProbeError(MemtocError):
    """Missing inputs of notebooks 02/03, or an impossible probes configuration."""


def band_of(pr: ProbesConfig, lm: LoadedModel) -> list[int]:
    b = model_entry(pr.bands, lm.name, lm.spec.label)
    top = lm.n_layers - 2                       # source layers stop below the last layer
    if b is None:
        return list(range(max(0, top - pr.default_band_layers + 1), top + 1))
    lo, hi = int(b[0]), min(int(b[1]), top)
    if not 0 <= lo <= hi:
        raise ConfigError(f"probes.bands.{lm.name}: {b} is not a range inside 0..{top}")
    return list(range(lo, hi + 1))


# -- inputs ------------------------------------------------------------------------------------
def read_scored(run_dir: Path, label: str, formulations: Sequence[str]) -> list[dict]:
    rows = []
    for f in formulations:
        p = RunPaths(run_dir).scored_file(label, arm_key("untreated", "schema", f))
        if not p.is_file():
            raise ProbeError(f"{p} does not exist: notebook 03_evaluation must run before 05_probes "
                             f"(model {label}, formulation {f})")
        with open(p, encoding="utf-8") as fh:
            rows += [json.loads(ln) for ln in fh if ln.strip()]
    return [r for r in rows if r.get("condition") == "tool_wrong" and r.get("frame", "schema") == "schema"]


def own_answer(row: dict) -> str:
    """The closed-book answer of a scored row as the lens reads it: ``memory_span`` without a leading
    answer label (``scoring.strip_answer_label``: "Answer: 1851" -> "1851"), so a scored file written
    before spans were stripped reads the same as a fresh one; "" for an absent answer."""
    if row.get("mem_absent"):
        return ""
    return strip_answer_label(str(row.get("memory_span") or "")).strip()


def episode_sets(rows: Sequence[dict]) -> dict[str, list[dict]]:
    arb = [r for r in rows if r.get("cell") == "arb"]
    own = [r for r in rows if canon(own_answer(r)) and canon(own_answer(r)) != canon(str(r.get("tool_value")))]
    return {"arbitration": arb, "own_answer": own}


def _first_tokens(lm: LoadedModel, answer: str) -> list[int]:
    return list(lm.tokenizer(answer.strip(), add_special_tokens=False)["input_ids"])


def control_pool(lm: LoadedModel, rows: Sequence[dict]) -> list[tuple[str, int]]:
    """(question id, first token of its closed-book answer) for every question of the model's rows
    with an answer, one entry per distinct pair, in row order: the control set's candidates (the
    paper's control is per model: other questions' elicited answers, not only the set's episodes)."""
    seen: dict[tuple[str, int], None] = {}
    for r in rows:
        toks = _first_tokens(lm, own_answer(r))
        if toks:
            seen.setdefault((str(r["question_id"]), toks[0]), None)
    return list(seen)


def pick_controls(question_id: str, own_first: int, pool: Sequence[tuple[str, int]], n: int,
                  start: int = 0) -> list[int]:
    """Up to ``n`` distinct first tokens of other questions' answers from ``pool`` (read cyclically
    from ``start``, so episodes draw different controls), never the episode's own question and never
    its own answer's first token."""
    out: list[int] = []
    for k in range(len(pool)):
        qid, tok = pool[(start + k) % len(pool)]
        if qid != str(question_id) and tok != own_first and tok not in out:
            out.append(tok)
            if len(out) >= n:
                break
    return out


def _rank_stats(ranks: Sequence[int]) -> dict[str, Any]:
    r = list(ranks)
    return {"median_rank": statistics.median(r) if r else None, "top20": sum(x <= TOP for x in r), "n": len(r)}


# -- the lens ------------------------------------------------------------------------------------
def run_lens(lm: LoadedModel, pr: ProbesConfig, rows: list[dict], run_dir: Path, docs_fit: list[str],
             docs_held: list[str], corpus_info: C.CorpusInfo, cache_root: Optional[Path] = None) -> dict[str, Any]:
    """The lens panel of one model: a published lens (``probes.lens_files``: path, URL or hf:// name,
    downloaded once into ``cache_root``, default the model cache) or one fitted here."""
    t0 = time.time()
    band = band_of(pr, lm)
    given = model_entry(pr.lens_files, lm.name, lm.spec.label)
    if given:
        where = f"probes.lens_files.{lm.name}"
        given = LF.published(lm.spec, where) if given == PUBLISHED_LENS else given
        src = LF.resolve(given, cache_root or model_cache_root(), where)
        lens = L.load_lens(src.path)
        L.check_lens(lens, lm, where)
        missing = [l for l in band if l not in lens.J]
        if missing:
            raise ConfigError(f"probes.lens_files.{lm.name}: {given} has no matrix for band layers {missing}")
        fit = {**src.to_dict(), "source": "given", "metadata": lens.metadata, "n_prompts": lens.n_prompts}
    else:
        key = L.fit_key(lm, corpus_info.sha256, band, pr.lens_skip_first, pr.lens_max_seq_len, len(docs_fit))
        out = RunPaths(run_dir).probe_lens(lm.spec.label, key)
        lens = L.fit_lens(lm, docs_fit, band, out, max_seq_len=pr.lens_max_seq_len,
                          skip_first=pr.lens_skip_first, dim_batch=pr.lens_dim_batch,
                          metadata={"model": lm.name, "weights_sha256": lm.weights_sha256,
                                    "corpus": corpus_info.to_dict()},
                          desc=f"{lm.spec.label}: Jacobian lens")
        fit = {"file": str((out / L.LENS_FILE).relative_to(run_dir)), "source": "fitted here", "n_prompts": lens.n_prompts,
               "n_tokens": lens.metadata.get("n_tokens"), "estimator": "exact (one-hot cotangents)"}
    t_fit = time.time() - t0
    held = [lm.encode_text(d, pr.heldout_max_seq_len) for d in docs_held]
    quality = L.lens_quality(lm, held, lens, band)
    t_q = time.time() - t0 - t_fit
    sets = episode_sets(rows)
    out_sets = {}
    for name in SETS:
        eps = [e for sp in SPLITS for e in [x for x in sets[name] if x["outcome"] == sp][: pr.lens_max_episodes]]
        out_sets[name] = lens_set(lm, lens, band, eps, pr.n_control, control_pool(lm, rows))
    return {"band": [band[0], band[-1]], "fit": fit | {"corpus": corpus_info.to_dict()},
            "quality": quality, "sets": out_sets,
            "seconds": {"fit": t_fit, "quality": t_q, "readout": time.time() - t0 - t_fit - t_q}}


def lens_set(lm: LoadedModel, lens: L.Lens, band: list[int], eps: list[dict], n_control: int,
             pool: Optional[Sequence[tuple[str, int]]] = None) -> dict[str, Any]:
    """Ranks of the closed-book answer (:func:`own_answer`) at the final input position, min over the
    band; controls (:func:`pick_controls`) from ``pool`` (default: the set's own episodes)."""
    eps = [e for e in eps if _first_tokens(lm, own_answer(e))]
    answers = [_first_tokens(lm, own_answer(e)) for e in eps]
    if pool is None:
        pool = control_pool(lm, eps)
    start = {q: k for k, (q, _) in reversed(list(enumerate(pool)))}
    per: dict[str, dict[str, list]] = {r: {k: [] for k in ("rank", "best", "layers", "control", "control_layers")}
                                       for r in L.READOUTS}
    qids = [e["question_id"] for e in eps]
    for i, e in enumerate(eps):
        others = pick_controls(qids[i], answers[i][0], pool, n_control, start.get(str(qids[i]), i) + 1)
        ids = lm.encode_prompt(e["prompt"])
        rk = L.readout_ranks(lm, ids, lens, band, {"first": answers[i][:1], "all": answers[i], "control": others})
        for r in L.READOUTS:
            first = {l: rk[r]["first"][l][0] for l in band}
            per[r]["layers"].append(first)
            per[r]["rank"].append(min(first.values()))
            per[r]["best"].append(min(min(rk[r]["all"][l]) for l in band))
            for c in range(len(others)):
                cl = {l: rk[r]["control"][l][c] for l in band}
                per[r]["control"].append(min(cl.values()))
                per[r]["control_layers"].append(cl)
    split = [e["outcome"] for e in eps]
    absent = [canon(own_answer(e)) not in canon(e["prompt"]) for e in eps]
    res: dict[str, Any] = {"n_episodes": len(eps), "n_both": split.count("both"), "n_neither": split.count("neither")}
    for r in L.READOUTS:
        d: dict[str, Any] = {}
        for s in SPLITS:
            idx = [i for i in range(len(eps)) if split[i] == s]
            d[s] = _rank_stats([per[r]["rank"][i] for i in idx])
        d["control"] = _rank_stats(per[r]["control"])
        d["best_subtoken"] = {s: _rank_stats([per[r]["best"][i] for i in range(len(eps)) if split[i] == s])
                              for s in SPLITS}
        d["answer_not_in_prompt"] = {s: _rank_stats([per[r]["rank"][i] for i in range(len(eps))
                                                     if split[i] == s and absent[i]]) for s in SPLITS}
        pl: dict[str, dict[int, Any]] = {}
        for s in SPLITS:
            idx = [i for i in range(len(eps)) if split[i] == s]
            pl[s] = {l: (statistics.median(per[r]["layers"][i][l] for i in idx) if idx else None) for l in band}
        pl["control"] = {l: (statistics.median(c[l] for c in per[r]["control_layers"])
                             if per[r]["control_layers"] else None) for l in band}
        d["per_layer"] = pl
        res[r] = d
    return res


# -- the SAE -------------------------------------------------------------------------------------
# -- the stage -----------------------------------------------------------------------------------
def run(cfg: RunConfig) -> dict[str, Any]:
    """Notebook 05's work for every model of the run; writes ``summaries/probes.json``. ``cfg``: the
    run configuration (a dict is refused)."""
    cfg = expect_config(cfg, "probes.run")
    pr, run_dir = cfg.probes, cfg.run_dir
    docs, cinfo = C.load_corpus(pr.corpus)
    docs_fit, docs_held = C.split_corpus(docs, max(pr.lens_fit_prompts, pr.sae_corpus_texts), pr.heldout_texts)
    bench = load_benchmark(cfg.release_dir)
    ev_path = cfg.paths.summary("evaluation")
    evaluation = json.loads(ev_path.read_text()) if ev_path.is_file() else {}
    summary: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "run_name": cfg.run_name,
                               "corpus": cinfo.to_dict(), "caveat": "",
                               "config": pr.to_dict(), "models": {}, "published": published(cfg.release_dir)}
    for name in pr.models:
        t0 = time.time()
        lm = load_model(name, cfg.model_cache_dir, dtype=pr.dtype)
        t_load = time.time() - t0
        rows = read_scored(run_dir, lm.spec.label, sorted(set(pr.lens_formulations) | set(pr.steer_formulations)))
        lens_rows = [r for r in rows if r["formulation"] in pr.lens_formulations]
        lz = run_lens(lm, pr, lens_rows, run_dir, docs_fit[: pr.lens_fit_prompts], docs_held, cinfo,
                      model_cache_root(cfg.model_cache_dir))
        t1 = time.time()
        sae = SR.run_sae(lm, cfg, rows, bench.questions, run_dir, docs_fit, cinfo, evaluation, band_of(pr, lm))
        summary["models"][name] = {
            "label": lm.spec.label, "chat": lm.spec.chat, "n_layers": lm.n_layers, "d_model": lm.d_model,
            "lens": lz["sets"], "lens_quality": lz["quality"], "lens_fit": {"band": lz["band"], **lz["fit"]},
            "sae": sae, "caveat": caveat(lm.spec, lz["fit"], (sae.get("dictionary") or {}).get("used", {})),
            "timing": {"load": t_load, **{f"lens_{k}": v for k, v in lz["seconds"].items()},
                       "sae_total": time.time() - t1, "total": time.time() - t0}}
        del lm
    summary["caveat"] = "\n".join(m["caveat"] for m in summary["models"].values())
    cfg.paths.write_summary("probes", summary)
    return summary


def published(release_dir=None) -> dict[str, Any]:
    """The paper's Table 8 and App. C blocks of the release's published_probes_agent_transfer.json."""
    try:
        p = resolve_release_dir(release_dir) / "published_probes_agent_transfer.json"
        d = json.loads(p.read_text())
    except (MemtocError, OSError, ValueError):
        return {}
    return {k: d[k] for k in d if k.startswith("lens") or k.startswith("sae")}
