"""SpARE-style clamped SAE edits (App. C; Zhao et al. 2024) and the steered replies.

The edit at layer ``l`` on a set of input positions (the last input position, or the tool-output
span), with the SAE codes ``z = encode(h)`` of each edited position::

    h' = h + alpha * ( sum_{f in add} max(mu_f - z_f, 0) W_dec[f]  -  sum_{f in remove} z_f W_dec[f] )

i.e. the *remove* features are clamped to 0 and the *add* features clamped up to their mean active
value ``mu_f`` on the mining episodes, scaled by the strength ``alpha`` (the paper swept 1-12);
``alpha = 0`` leaves ``h`` bit for bit. A multi-layer arm applies one such edit at each of its
layers (each with that layer's dictionary and features, one ``alpha``) in the same forward pass.
Direction ``to_memory`` adds the kept-memory features and removes the followed-tool ones;
``to_tool`` the reverse. The edit applies to the prompt's forward
pass only (the KV cache carries it into every decode step); decoding is greedy, one prompt at a
time, and stops at EOS, at the first completed FINAL line, or at ``max_new_tokens``.

Replies go through :class:`memtoc.generation.backends.base.Generator`'s cache (one JSONL file per model, keys
= the edit's identity + the prompt), so an interrupted sweep resumes.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from memtoc.core.scoring import has_final_line, score_reply
from memtoc.core.stats import clopper_pearson
from memtoc.core.vocab import PROMPTING_ARMS
from memtoc.generation.backends.base import Generator, Reply, line_stop
from memtoc.generation.backends.hf import cache_keyword
from memtoc.generation.templates import render_prompt
from memtoc.stages.probes.dictionaries import SparseDictionary
from memtoc.stages.probes.hfmodel import LoadedModel, layer_hooks
from memtoc.stages.probes.mining import MEMORY, TOOL

TARGET = {"to_memory": MEMORY, "to_tool": TOOL}


@dataclass(frozen=True)
class Edit:
    layer: int
    direction: str
    position: str
    strength: float
    add: tuple[int, ...]
    add_values: tuple[float, ...]
    remove: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "direction": self.direction, "position": self.position,
                "strength": self.strength, "add": list(self.add), "add_values": list(self.add_values),
                "remove": list(self.remove)}


def edit_delta(sae: SparseDictionary, h: torch.Tensor, edit: Edit) -> torch.Tensor:
    """The (unscaled) clamp vector for residual rows ``h`` (n, d)."""
    z = sae.encode(h)
    delta = torch.zeros_like(h)
    if edit.add:
        idx = torch.tensor(edit.add, device=h.device)
        mu = torch.tensor(edit.add_values, dtype=h.dtype, device=h.device)
        delta = delta + (mu - z[:, idx]).clamp_min(0) @ sae.W_dec[idx]
    if edit.remove:
        idx = torch.tensor(edit.remove, device=h.device)
        delta = delta - z[:, idx] @ sae.W_dec[idx]
    return delta


def apply_edit(sae: SparseDictionary, h: torch.Tensor, positions: Sequence[int], edit: Edit) -> torch.Tensor:
    """``h`` (1, T, d) with the edit applied at ``positions`` (a new tensor; strength 0: equal)."""
    out = h.clone()
    pos = torch.tensor(list(positions), dtype=torch.long, device=h.device)
    rows = h[0, pos]
    out[0, pos] = (rows + edit.strength * edit_delta(sae, rows, edit)).to(out.dtype)
    return out


def char_span_positions(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Token positions whose character span overlaps [start, end)."""
    return [i for i, (a, b) in enumerate(offsets) if b > start and a < end and b > a]


def edit_positions(lm: LoadedModel, prompt: str, position: str, span_text: Optional[str]) -> tuple[list[int], list[int]]:
    """(token ids of the rendered prompt, positions to edit)."""
    text, add_special = render_prompt(lm.tokenizer, lm.spec, prompt)
    enc = lm.tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if position == "last":
        return ids, [len(ids) - 1]
    if not span_text or span_text not in text:
        raise ValueError(f"tool-output span {span_text!r} not found in the rendered prompt")
    a = text.rindex(span_text)
    pos = char_span_positions(enc["offset_mapping"], a, a + len(span_text))
    if not pos:
        raise ValueError("the tool-output span covers no token")
    return ids, pos


class SteeredGenerator(Generator):
    """Greedy decoding of ``lm`` with SAE edits on the prompt's forward pass: one edit per layer,
    every layer of a multi-layer arm edited in the same pass (``edits``: (dictionary, its sha256,
    edit) per layer, all at one position kind)."""

    backend = "memtoc-probes-steer"

    def __init__(self, lm: LoadedModel, edits: Sequence[tuple[SparseDictionary, str, Edit]], spans: dict[str, str],
                 max_new_tokens: int = 48, stop_at_final: bool = True, stop_at_first_line: Optional[bool] = None):
        edits = list(edits)
        if not edits or len({e.layer for _, _, e in edits}) != len(edits) or len({e.position for _, _, e in edits}) != 1:
            raise ValueError("a steered generator takes one edit per layer (at least one), all at one position kind")
        # a base model's reply is its first complete line, as in notebook 03 (models.load_generator)
        if stop_at_first_line is None:
            stop_at_first_line = not lm.spec.chat
        # one edit keeps the single-layer identity (its cached replies stay valid); an arm lists its layers'
        shas, dicts = [sha for _, sha, _ in edits], [e.to_dict() for _, _, e in edits]
        ident = {"backend": self.backend, "decoder": "greedy-batch1-v1", "model": lm.name,
                 "weights_sha256": lm.weights_sha256, "sae_sha256": shas[0] if len(edits) == 1 else shas,
                 "edit": dicts[0] if len(edits) == 1 else dicts,
                 "max_new_tokens": max_new_tokens, "stop_at_final": stop_at_final,
                 **({"stop_at_first_line": True} if stop_at_first_line else {}),
                 **({"dtype": lm.dtype} if lm.dtype != "float32" else {})}
        super().__init__(ident)
        self.lm, self.edits, self.spans = lm, [(sae, e) for sae, _, e in edits], spans
        self.position = edits[0][2].position
        self.max_new_tokens, self.stop_at_final = max_new_tokens, stop_at_final
        self.stop_at_first_line = bool(stop_at_first_line)

    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        for i, p in enumerate(prompts):
            yield [i], [self.reply(p)]

    def reply(self, prompt: str) -> Reply:
        t0 = time.time()
        lm, model = self.lm, self.lm.model
        ids, pos = edit_positions(lm, prompt, self.position, self.spans.get(prompt))
        state = {"prefill": True}

        def hook_for(sae: SparseDictionary, edit: Edit):
            def hook(h):
                return apply_edit(sae, h, pos, edit) if state["prefill"] else None
            return hook

        eos = set(_as_list(model.generation_config.eos_token_id)) | {lm.tokenizer.eos_token_id}
        new: list[int] = []
        finish = "length"
        ckw = cache_keyword(model)
        with torch.no_grad(), layer_hooks(model, {e.layer: hook_for(sae, e) for sae, e in self.edits}):
            out = model(input_ids=lm.ids(ids), use_cache=True)
            state["prefill"] = False
            past = _past(out, ckw)
            nxt = int(out.logits[0, -1].argmax())
            for _ in range(self.max_new_tokens):
                if nxt in eos:
                    finish = "eos"
                    break
                new.append(nxt)
                rule = line_stop(lm.tokenizer.decode(new, skip_special_tokens=True), self.stop_at_final,
                                 self.stop_at_first_line)
                if rule:
                    finish = rule
                    break
                out = model(input_ids=lm.ids([nxt]), use_cache=True, **{ckw: past})
                past = _past(out, ckw)
                nxt = int(out.logits[0, -1].argmax())
        text = lm.tokenizer.decode(new, skip_special_tokens=True)
        return Reply(text=text, n_prompt_tokens=len(ids), n_new_tokens=len(new), seconds=time.time() - t0,
                     finish=finish, key="", cached=False)


def _past(out, ckw: str):
    for name in (ckw, "past_key_values"):
        v = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if v is not None:
            return v
    raise RuntimeError("the model returned no KV cache")


def _as_list(v) -> list:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def sae_sha256(sae: SparseDictionary) -> str:
    h = hashlib.sha256()
    for k, v in sorted(sae.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# -- scoring -------------------------------------------------------------------------------------
_WORD = re.compile(r"\w+")


def degeneration(text: str, schema_name: Optional[str] = None) -> dict[str, bool]:
    """No FINAL line; repetition (a word 4-gram three or more times); schema echo (the reply
    repeats the tool schema's JSON keys or its name)."""
    words = _WORD.findall(text.lower())
    grams: dict[tuple, int] = {}
    for i in range(len(words) - 3):
        g = tuple(words[i:i + 4])
        grams[g] = grams.get(g, 0) + 1
    rep = any(c >= 3 for c in grams.values())
    echo = '"parameters"' in text or '"properties"' in text or bool(schema_name and schema_name in text)
    no_final = not has_final_line(text)
    return {"no_final": no_final, "repetition": rep, "schema_echo": echo, "any": no_final or rep or echo}


def score(text: str, ep: dict, matcher: str) -> dict[str, Any]:
    s = score_reply(text, ep["gold"], ep["tool_value"], ep.get("memory_span"), matcher, ep.get("gold_kind"))
    schema = (ep.get("schema") or {}).get("name") if isinstance(ep.get("schema"), dict) else None
    s["degeneration"] = degeneration(text, schema)
    return s


def on_target(s: dict, direction: str) -> bool:
    if direction == "to_memory":
        return bool(s["kept_memory"] and not s["followed_tool"])
    return bool(s["followed_tool"] and not s["kept_memory"])


def _rate(k: int, n: int) -> dict[str, Any]:
    return {"value": k / n if n else None, "ci95": clopper_pearson(k, n) if n else None, "k": k, "n": n}


def cell(direction: str, base: Sequence[dict], steered: Sequence[dict], bar: Optional[float],
         bar_kind: str = "pooled") -> dict[str, Any]:
    """One steering cell from paired baseline (strength 0) and steered scores of the same episodes.
    ``clears_bar`` compares the bar with the change toward the target (``bar_kind`` pooled: the bar is
    half a pooled change) or with the flip rate (dev_flip: the bar is half a prompt sentence's flip of
    the same episodes); a change of zero never clears it."""
    n = len(base)
    elig = [i for i in range(n) if not on_target(base[i], direction)]
    flips = sum(on_target(steered[i], direction) for i in elig)
    ft_b = sum(b["followed_tool"] for b in base)
    ft_s = sum(s["followed_tool"] for s in steered)
    km_b = sum(b["kept_memory"] for b in base)
    km_s = sum(s["kept_memory"] for s in steered)
    d_ft = (ft_s - ft_b) / n if n else None
    d_km = (km_s - km_b) / n if n else None
    toward = (d_km if direction == "to_memory" else d_ft)
    flip = flips / len(elig) if elig else None
    versus = flip if bar_kind == "dev_flip" else toward
    return {"n": n, "flip_rate": _rate(flips, len(elig)),
            "delta_followed_tool": d_ft, "delta_kept_memory": d_km,
            "lands_on_neither": _rate(sum(s["outcome"] == "neither" for s in steered), n),
            "degeneration": _rate(sum(s["degeneration"]["any"] for s in steered), n),
            "degeneration_baseline": _rate(sum(b["degeneration"]["any"] for b in base), n),
            "degeneration_parts": {k: sum(s["degeneration"][k] for s in steered)
                                   for k in ("no_final", "repetition", "schema_echo")},
            "toward_target": toward,
            # a change of zero never clears (a zero prompting effect gives a zero bar: the knob must still move)
            "clears_bar": None if (bar is None or versus is None) else bool(versus >= bar and versus > 0)}


def prompting_bar(evaluation_summary: dict, model: str, arms: Sequence[str] = PROMPTING_ARMS) -> dict[str, Any]:
    """The paper's stopping bar: half the run's own prompting effect, the largest pooled reduction
    in wrong-tool following (notebook 03's ``prompting/<arm>/contrasts/wrong_follow/delta``), over every
    prompting arm of the vocabulary (a tie goes to the earlier arm there)."""
    p = ((evaluation_summary.get("models") or {}).get(model) or {}).get("prompting") or {}
    deltas = {}
    for a in arms:
        d = (((p.get(a) or {}).get("contrasts") or {}).get("wrong_follow") or {}).get("delta")
        if d is not None:
            deltas[a] = d
    if not deltas:
        return {"kind": "pooled", "bar": None, "effect": None, "arm": None, "deltas": {},
                "note": f"no prompting contrast for {model} in notebook 03's summary (extra_arms without 'prompting'?): "
                        "no stopping bar"}
    arm = min(deltas, key=lambda a: deltas[a])
    effect = abs(deltas[arm])
    return {"kind": "pooled", "bar": effect / 2, "effect": effect, "arm": arm, "deltas": deltas,
            "note": "half the largest |pooled change in wrong-tool following| among the prompting arms"}



def episode_key(row: dict) -> tuple[str, str, str, str]:
    """The episode a scored row is about, whatever its prompt arm: (question, condition, formulation, frame)."""
    return (str(row["question_id"]), str(row["condition"]), str(row["formulation"]), str(row.get("frame", "schema")))


def dev_flip_bar(dev: Sequence[dict], arm_rows: dict[str, dict[tuple, dict]], direction: str = "to_memory"
                 ) -> dict[str, Any]:
    """App. C's stopping bar: half the prompting effect *on the dev flip*. ``dev``: the steered
    episodes of ``direction`` (their untreated replies off target); ``arm_rows``: per prompt
    sentence, notebook 03's scored rows by :func:`episode_key`. A sentence's dev flip is the share of
    the dev episodes whose reply under the sentence lands on the direction's side (the flip an edit is
    scored by); the bar is half the largest. Direction-agnostic as in the paper's qualification run:
    the one bar, measured memory-ward, is applied to both directions."""
    flips: dict[str, dict[str, Any]] = {}
    for arm, rows in arm_rows.items():
        got = [rows.get(episode_key(e)) for e in dev]
        if not dev or any(g is None for g in got):
            continue
        flips[arm] = _rate(sum(on_target(g, direction) for g in got), len(dev))
    if not flips:
        return {"kind": "dev_flip", "bar": None, "effect": None, "arm": None, "flips": {}, "n": len(dev),
                "note": f"no prompt sentence of notebook 03 covers the {len(dev)} dev episode(s) of {direction}: "
                        "no stopping bar"}
    arm = max(flips, key=lambda a: (flips[a]["value"], a))
    effect = flips[arm]["value"]
    return {"kind": "dev_flip", "bar": effect / 2, "effect": effect, "arm": arm, "flips": flips, "n": len(dev),
            "note": f"half the largest {direction} flip of the dev episodes under a prompt sentence (notebook 03's "
                    "replies), applied to both directions"}
