"""Notebook 05's SAE steering probe (App. C) for one model: dictionaries per layer (given or trained
here) with their FVU gate, feature mining, and the edits of every arm on the other fold's episodes.

Arms: each single layer of ``probes.sae_layers`` (the band's middle layer by default) at every
position of ``probes.positions``, plus App. C's multi-layer arms of ``probes.arms`` (e.g. GemmaScope
PT layers 23-26 at the last input position, or every layer of the band on the tool-output span):
one forward pass edits every layer of the arm at once, each layer with its own dictionary and
features, at one strength. A multi-layer arm passes the FVU gate when the median of its layers'
held-out FVU does (App. C: "the multi-layer arm's median passes").

Mining set (``probes.mining_set``): ``fold``, the mining fold's tool-wrong episodes; or
``dpo_pairs``, those of them that underlie notebook 04's DPO pair set of that fold (the tool-wrong
training examples of ``finetune.crossfit.plan``: the same questions and formulations, labelled by
the model's own untreated replies). Stopping bar (``probes.steer_bar``): ``pooled``, half of 03's
pooled prompting effect; or ``dev_flip``, half the prompting effect on the steered episodes' own
flip (``steering.dev_flip_bar``).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from memtoc.config.blocks import model_entry
from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core.errors import ConfigError
from memtoc.core.records import arm_key
from memtoc.core.vocab import BAND, PROMPTING_ARMS
from memtoc.generation.weights import model_cache_root
from memtoc.stages.finetune import crossfit
from memtoc.stages.probes import corpus as C, dictfiles as DF, dictionaries as D, mining as M, sae as S, steering as ST
from memtoc.stages.probes.hfmodel import LoadedModel


@dataclass(frozen=True)
class Arm:
    """One steering arm: the layers edited together and the position kind of the edit."""

    layers: tuple[int, ...]
    position: str

    @property
    def name(self) -> str:
        ls = self.layers
        span = f"{ls[0]}-{ls[-1]}" if len(ls) > 1 and list(ls) == list(range(ls[0], ls[-1] + 1)) \
            else ",".join(map(str, ls))
        return f"L{span}@{self.position}"


def multi_arms(cfg: RunConfig, lm: LoadedModel, band: Sequence[int]) -> list[Arm]:
    """The model's multi-layer arms of ``probes.arms`` (``band``: every source layer of the band)."""
    out = []
    for i, a in enumerate(model_entry(cfg.probes.arms, lm.name, lm.spec.label) or []):
        layers = tuple(band) if a["layers"] == BAND else tuple(sorted(int(l) for l in a["layers"]))
        bad = [l for l in layers if not 0 <= l < lm.n_layers]
        if bad:
            raise ConfigError(f"probes.arms.{lm.name}[{i}].layers: {bad} outside the model's layers 0..{lm.n_layers - 1}")
        out.append(Arm(layers, a.get("position", "last")))
    return out


def pair_hop_keys(cfg: RunConfig) -> set[tuple[str, str]]:
    """(question, formulation) of every tool-wrong training example of notebook 04's DPO pair set
    of fold ``probes.mine_fold`` (``finetune.crossfit.plan``; no training)."""
    plans, examples = crossfit.plan(cfg)
    fold = cfg.probes.mine_fold
    if fold not in examples:
        raise ConfigError(f"probes.mine_fold: {fold} is not a training fold of finetune.folds "
                          f"{sorted(examples)}; mining_set dpo_pairs mines on that fold's pair set")
    return {(e.question_id, e.formulation) for e in examples[fold] if e.condition == "tool_wrong"}


def mining_rows(cfg: RunConfig, rows: list[dict], questions) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(mining rows, edit rows, split info) under ``probes.mining_set``."""
    mine, edit, info = M.split_folds(rows, questions, cfg.probes.mine_fold)
    info["mining_set"] = cfg.probes.mining_set
    if cfg.probes.mining_set == "dpo_pairs":
        keys = pair_hop_keys(cfg)
        mine = [r for r in mine if (r["question_id"], r["formulation"]) in keys]
        info.update({"n_pair_hops": len(keys), "n_pair_hops_with_reply": len(mine), "n_mine": len(mine),
                     "note": "tool-wrong hops of 04's DPO pair set of the mining fold with the model's untreated "
                             "reply in this run (a pair-set hop outside the run's questions or formulations has none)"})
    return mine, edit, info


def read_arm_rows(run_dir: Path, label: str, formulations: Sequence[str]) -> dict[str, dict[tuple, dict]]:
    """Notebook 03's scored rows of each prompt sentence (``PROMPTING_ARMS``), by
    ``steering.episode_key``; a sentence without a scored file for every formulation is left out."""
    out: dict[str, dict[tuple, dict]] = {}
    for arm in PROMPTING_ARMS:
        paths = [RunPaths(run_dir).scored_file(label, arm_key(arm, "schema", f)) for f in formulations]
        if not all(p.is_file() for p in paths):
            continue
        rows: dict[tuple, dict] = {}
        for p in paths:
            with open(p, encoding="utf-8") as fh:
                for ln in fh:
                    if ln.strip():
                        r = json.loads(ln)
                        rows[ST.episode_key(r)] = r
        out[arm] = rows
    return out


def dictionaries(lm: LoadedModel, cfg: RunConfig, layers: Sequence[int], mine: list[dict], docs_fit: list[str],
                 corpus_info: C.CorpusInfo, run_dir: Path, timing: dict) -> tuple[dict, dict]:
    """(per-layer record, {layer: (dictionary, sha256)}): a given dictionary (``probes.sae_files``) or
    one trained here on the mining fold's prompts plus generic documents; FVU on held-out prompts."""
    pr = cfg.probes
    n_held = min(pr.sae_heldout_prompts, len(mine) // 4)
    held_eps = mine[len(mine) - n_held:]
    train_eps = mine[: min(pr.sae_prompts, len(mine) - n_held)]
    seq_train = [lm.encode_prompt(r["prompt"])[: pr.sae_max_seq_len] for r in train_eps]
    seq_train += [lm.encode_text(d, pr.sae_max_seq_len) for d in docs_fit[: pr.sae_corpus_texts]]
    seq_held = [lm.encode_prompt(r["prompt"])[: pr.sae_max_seq_len] for r in held_eps]
    files = model_entry(pr.sae_files, lm.name, lm.spec.label) or {}
    out_layers: dict[str, Any] = {}
    saes: dict[int, tuple[D.SparseDictionary, str]] = {}
    for l in layers:
        t1 = time.time()
        acts = torch.cat(S.layer_acts(lm, seq_train, l))
        held = torch.cat(S.layer_acts(lm, seq_held, l))
        timing[f"sae_layer{l}_activations"] = time.time() - t1
        given = files.get(l, files.get(str(l)))
        if given:
            where = f"probes.sae_files.{lm.name}.{l}"
            local, src = DF.resolve(given, model_cache_root(cfg.model_cache_dir), where)
            sae, dcfg = D.load_sae(local)
            if sae.d_in != lm.d_model:
                raise ConfigError(f"{where}: {given} reads d_in = {sae.d_in}, the model's "
                                  f"d_model is {lm.d_model}; name the dictionary of this model's layer {l}")
            info = {"source": "given", "file": str(given), "layout": dcfg["layout"],
                    "architecture": sae.architecture, "url": src.get("url"), "sha256": src["files"]}
        else:
            sae, info = S.train_topk(acts, pr.sae_expansion * lm.d_model, pr.sae_k, pr.sae_steps,
                                     pr.sae_batch, pr.sae_lr, seed=cfg.seed + l)
            d = RunPaths(run_dir).probe_sae(lm.spec.label, l)
            S.save_sae(sae, d, model_name=lm.name, layer=l,
                       extra={"corpus": corpus_info.to_dict(), "train": info})
            info = info | {"source": "trained here", "file": str(d.relative_to(run_dir))}   # relative: the run moves
        timing[f"sae_layer{l}_train"] = time.time() - t1 - timing[f"sae_layer{l}_activations"]
        m = S.metrics(sae, held)
        m["passes_gate"] = bool(m["fvu"] < pr.fvu_gate)
        m_train = S.metrics(sae, acts)
        out_layers[str(l)] = {**m, "fvu_train": m_train["fvu"], "dead_fraction_train": m_train["dead_fraction"],
                              "spliced_loss": S.spliced_loss(lm, seq_held, l, sae), "gate": pr.fvu_gate,
                              "n_train_tokens": int(acts.shape[0]), **info}
        saes[l] = (sae, ST.sae_sha256(sae))
        timing[f"sae_layer{l}_total"] = time.time() - t1
    return out_layers, saes


def arm_gate(arm: Arm, layers: dict[str, Any], gate: float) -> dict[str, Any]:
    """A multi-layer arm's FVU gate: the median of its layers' held-out FVU below ``gate``."""
    med = statistics.median(layers[str(l)]["fvu"] for l in arm.layers)
    return {"fvu_median": med, "passes_gate": bool(med < gate), "gate": gate}


def run_sae(lm: LoadedModel, cfg: RunConfig, rows: list[dict], questions, run_dir: Path,
            docs_fit: list[str], corpus_info: C.CorpusInfo, evaluation: dict, band: Sequence[int]) -> dict[str, Any]:
    """The SAE probe of one model (``band``: its source layers; seed: the run's seed plus the layer)."""
    pr = cfg.probes
    timing: dict[str, float] = {}
    mine, edit, split_info = mining_rows(cfg, rows, questions)
    mine_q = sorted({r["question_id"] for r in mine})
    if min(pr.sae_heldout_prompts, len(mine) // 4) < 1:
        return {"layers": {}, "split": split_info, "mined_questions": len(mine_q), "timing": timing,
                "steer": {"skipped": f"too few mining-set tool-wrong episodes ({len(mine)}) for an SAE with a "
                                     "held-out set; larger n_questions"}}
    singles = [int(l) for l in (model_entry(pr.sae_layers, lm.name, lm.spec.label) or [band[len(band) // 2]])]
    arms = multi_arms(cfg, lm, band)
    needed = sorted(set(singles) | {l for a in arms for l in a.layers})
    out_layers, saes = dictionaries(lm, cfg, needed, mine, docs_fit, corpus_info, run_dir, timing)
    named = model_entry(pr.dictionaries, lm.name, lm.spec.label)
    res: dict[str, Any] = {"layers": out_layers, "split": split_info, "mined_questions": len(mine_q),
                           "dictionary": {"paper": named, "used": {l: out_layers[str(l)]["source"] for l in needed},
                                          "note": ("probes.sae_files names local copies of released dictionaries "
                                                   "(ReLU, JumpReLU or TopK in sae-lens's, GemmaScope's or Llama "
                                                   "Scope's layout; probes.dictionaries.load_sae); without one a "
                                                   "TopK dictionary is trained here")}}
    gates = {a.name: arm_gate(a, out_layers, pr.fvu_gate) for a in arms}
    res["arms"] = {a.name: {"layers": list(a.layers), "position": a.position, **gates[a.name]} for a in arms}
    passing = [l for l in singles if out_layers[str(l)]["passes_gate"]]
    passing_arms = [a for a in arms if gates[a.name]["passes_gate"]]
    res["steer"] = {}
    if not passing and not passing_arms:
        res["steer"]["skipped"] = f"no dictionary or arm passes the FVU gate (< {pr.fvu_gate}); no edit is run"
        res["timing"] = timing
        return res
    res["mining"] = mine_and_steer(lm, cfg, mine, edit, passing, passing_arms, saes, run_dir, evaluation,
                                   res["steer"], questions, timing)
    res["timing"] = timing
    return res


def _labelled(rows: list[dict], n: int) -> list[dict]:
    out = []
    for lab in (M.MEMORY, M.TOOL):
        out += [r for r in rows if r["outcome"] == lab][:n]
    return out


def steer_bar(cfg: RunConfig, lm: LoadedModel, run_dir: Path, evaluation: dict, dev_to_memory: list[dict]
              ) -> dict[str, Any]:
    """The stopping bar of ``probes.steer_bar`` for this model's steered episodes."""
    if cfg.probes.steer_bar == "dev_flip":
        return ST.dev_flip_bar(dev_to_memory, read_arm_rows(run_dir, lm.spec.label, cfg.probes.steer_formulations))
    return ST.prompting_bar(evaluation, lm.name)


def mine_and_steer(lm: LoadedModel, cfg: RunConfig, mine: list[dict], edit: list[dict], singles: list[int],
                   arms: list[Arm], saes: dict, run_dir: Path, evaluation: dict, steer_out: dict, questions,
                   timing: dict) -> dict[str, Any]:
    """Mine features per layer on the mining set (half for MI, half for the held-out cross-check),
    then run the single-layer and multi-layer edits on the other fold's episodes."""
    pr = cfg.probes
    qs = sorted({r["question_id"] for r in mine})
    half = set(qs[0::2])
    mi_rows = _labelled([r for r in mine if r["question_id"] in half], pr.mine_per_label)
    ho_rows = _labelled([r for r in mine if r["question_id"] not in half], pr.mine_per_label)
    out: dict[str, Any] = {"n_mi": len(mi_rows), "n_heldout": len(ho_rows),
                           "n_mi_by_label": {lab: sum(r["outcome"] == lab for r in mi_rows) for lab in (M.MEMORY, M.TOOL)}}
    forms = set(pr.steer_formulations)
    cand = [r for r in edit if r["formulation"] in forms]
    sel = {"to_memory": [r for r in cand if r["outcome"] == M.TOOL][: pr.steer_per_direction],
           "to_tool": [r for r in cand if r["outcome"] == M.MEMORY][: pr.steer_per_direction]}
    M.assert_disjoint(mi_rows + ho_rows, sel["to_memory"] + sel["to_tool"], questions)
    bar = steer_out["bar"] = steer_bar(cfg, lm, run_dir, evaluation, sel["to_memory"])
    feats: dict[int, dict] = {}
    for l in sorted(set(singles) | {l for a in arms for l in a.layers}):
        t0 = time.time()
        sae, _ = saes[l]
        z = sae.encode(torch.cat(S.layer_acts(lm, [lm.encode_prompt(r["prompt"]) for r in mi_rows], l, "last")))
        zh = sae.encode(torch.cat(S.layer_acts(lm, [lm.encode_prompt(r["prompt"]) for r in ho_rows], l, "last"))) \
            if ho_rows else torch.zeros(0, sae.d_sae)
        feats[l] = M.mine_features(z, [r["outcome"] for r in mi_rows], zh, [r["outcome"] for r in ho_rows],
                                   pr.top_features, mi_share=pr.feature_mi_share)
        out[str(l)] = {"features": M.feature_table(feats[l]), "per_side": {s: len(feats[l][s]) for s in feats[l]},
                       "heldout_agreement": {s: [f.agrees for f in feats[l][s]] for s in feats[l]}}
        timing[f"mining_layer{l}"] = time.time() - t0
    for where, layers, positions in [(str(l), [l], pr.positions) for l in singles] + \
                                    [(a.name, list(a.layers), [a.position]) for a in arms]:
        t0 = time.time()
        parts = [(saes[l][0], saes[l][1], l, feats[l]) for l in layers
                 if feats[l][M.MEMORY] or feats[l][M.TOOL]]
        cell = steer_out if len(layers) == 1 else steer_out.setdefault("arms", {})
        if not parts:
            cell[where] = {"skipped": "no feature separates the labels on the mining episodes"}
            continue
        cell[where] = ({"layers": [p[2] for p in parts]} if len(layers) > 1 else {}) | \
            steer_edits(lm, cfg, parts, positions, sel, run_dir, bar)
        timing[f"steering_{'layer' if len(layers) == 1 else 'arm '}{where}"] = time.time() - t0
    out["edit_episodes"] = {d: [r["episode_id"] for r in v] for d, v in sel.items()}
    return out


def steer_edits(lm: LoadedModel, cfg: RunConfig, parts: list, positions: Sequence[str], sel: dict, run_dir: Path,
                bar: dict) -> dict[str, Any]:
    """Every direction x position x strength cell of one arm (``parts``: (dictionary, sha256, layer,
    features) per edited layer), each against the same episodes' strength-0 replies."""
    pr = cfg.probes
    cache = RunPaths(run_dir).probe_steer_cache(lm.spec.label)
    cache.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    for d in pr.directions:
        eps = sel[d]
        if not eps:
            res[d] = {"skipped": f"no edit-fold episode with the baseline label for {d}"}
            continue
        add_side, rem_side = (M.MEMORY, M.TOOL) if d == "to_memory" else (M.TOOL, M.MEMORY)
        prompts = [e["prompt"] for e in eps]
        spans = {e["prompt"]: json.dumps(e["tool_output"], ensure_ascii=False) for e in eps}
        res[d] = {"n": len(eps)}

        def replies_at(pos: str, s: float):
            edits = [(sae, sha, ST.Edit(l, d, pos, float(s), tuple(f.index for f in fs[add_side]),
                                        tuple(f.mean_act for f in fs[add_side]), tuple(f.index for f in fs[rem_side])))
                     for sae, sha, l, fs in parts]
            gen = ST.SteeredGenerator(lm, edits, spans, max_new_tokens=cfg.max_new_tokens)
            return gen.generate(prompts, cache_path=cache, desc=f"{lm.spec.label}: steer {d} {pos} x{s}")

        base = replies_at("last", 0)      # strength 0: the unedited baseline (one per direction and arm)
        base_scores = [ST.score(r.text, e, cfg.matcher) for r, e in zip(base, eps)]
        res[d]["baseline"] = {"n": len(eps), "matches_run_replies": sum(r.text == e.get("response")
                                                                         for r, e in zip(base, eps)),
                              "on_target": sum(ST.on_target(x, d) for x in base_scores),
                              "degeneration": sum(x["degeneration"]["any"] for x in base_scores)}
        for pos in positions:
            res[d][pos] = {}
            for s in pr.strengths:
                scores = [ST.score(r.text, e, cfg.matcher) for r, e in zip(replies_at(pos, s), eps)]
                res[d][pos][str(s)] = ST.cell(d, base_scores, scores, bar["bar"], bar.get("kind", "pooled"))
    return res
