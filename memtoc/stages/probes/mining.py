"""Features that separate kept-memory from followed-tool episodes (App. C, after SpARE): mutual
information between a latent's activity (active / not, at the last input position) and the
behaviour label on the mining episodes, cross-checked by the frequency separation (P(active | kept
memory) - P(active | followed tool)) on held-out tool-wrong episodes of the same fold.

The mining and the edit sets come from different frozen folds and share no chain (instance) and no
related-question link (``construct.related_links``): :func:`split_folds` builds them and
:func:`assert_disjoint` refuses an overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from memtoc.core.errors import MemtocError
from memtoc.stages.construction import related_links

MEMORY, TOOL = "kept_memory", "followed_tool"


class SplitError(MemtocError):
    """Mining and edit sets overlap."""


@dataclass(frozen=True)
class Feature:
    index: int
    side: str            # kept_memory | followed_tool: the label it is more active on
    mi: float            # mutual information (nats) on the mining episodes
    freq_memory: float   # P(active | kept memory) on the mining episodes
    freq_tool: float
    mean_act: float      # mean activation when active (the clamp value of the edit)
    heldout_sep: float | None   # held-out P(active | memory) - P(active | tool); None: no held-out pair
    agrees: bool | None  # held-out separation has the mining side's sign


def split_folds(rows: Iterable[dict], questions: Sequence[Any], mine_fold: int) -> tuple[list[dict], list[dict], dict]:
    """(mining rows, edit rows, info): rows of fold ``mine_fold`` mine, the other fold's are edited,
    minus any edit row whose chain is in the mining set or that is linked to a mining question
    (either direction of ``related_links``)."""
    rows = list(rows)
    mine = [r for r in rows if r.get("fold") == mine_fold]
    rest = [r for r in rows if r.get("fold") is not None and r.get("fold") != mine_fold]
    mine_ids = {r["question_id"] for r in mine}
    mine_chains = {r["instance_id"] for r in mine}
    linked: set[str] = set()
    for ln in related_links(questions):
        if ln["gold_id"] in mine_ids:
            linked.add(ln["subject_id"])
        if ln["subject_id"] in mine_ids:
            linked.add(ln["gold_id"])
    edit = [r for r in rest if r["instance_id"] not in mine_chains and r["question_id"] not in linked]
    info = {"mine_fold": mine_fold, "n_mine": len(mine), "n_edit_candidates": len(rest),
            "n_dropped_linked_or_shared_chain": len(rest) - len(edit)}
    assert_disjoint(mine, edit, questions)
    return mine, edit, info


def assert_disjoint(mine: Sequence[dict], edit: Sequence[dict], questions: Sequence[Any]) -> None:
    chains = {r["instance_id"] for r in mine} & {r["instance_id"] for r in edit}
    if chains:
        raise SplitError(f"mining and edit sets share chain(s) {sorted(chains)[:5]}")
    mi, ed = {r["question_id"] for r in mine}, {r["question_id"] for r in edit}
    for ln in related_links(questions):
        if (ln["gold_id"] in mi and ln["subject_id"] in ed) or (ln["gold_id"] in ed and ln["subject_id"] in mi):
            raise SplitError(f"mining and edit sets are linked: {ln['gold_id']} -> {ln['subject_id']}")


def mutual_information(active: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """MI (nats) between binary activity (n, m) and a binary label (n,), per latent."""
    a = active.float()
    y = label.float()[:, None]
    n = a.shape[0]
    mi = torch.zeros(a.shape[1], dtype=torch.float64)
    for av in (0, 1):
        pa = (a == av).double().mean(0)
        for yv in (0, 1):
            py = float((y == yv).double().mean())
            pj = ((a == av) & (y == yv)).double().sum(0) / n
            term = pj * torch.log(pj / (pa * py).clamp_min(1e-300))
            mi += torch.where(pj > 0, term, torch.zeros_like(term))
    return mi


def mi_budget(mi_desc: Sequence[float], share: float) -> int:
    """App. C's feature budget K as a share of mutual information (after SpARE): the fewest latents,
    taken in descending MI order, whose MI adds up to at least ``share`` of the MI of all of them
    (0 when none carries any)."""
    total = float(sum(mi_desc))
    if total <= 0:
        return 0
    acc = 0.0
    for k, v in enumerate(mi_desc, 1):
        acc += float(v)
        if acc >= share * total * (1 - 1e-12):
            return k
    return len(mi_desc)


def mine_features(z: torch.Tensor, label: Sequence[str], z_held: torch.Tensor, label_held: Sequence[str],
                  top: int = 8, mi_share: float | None = None) -> dict[str, list[Feature]]:
    """The latents that separate the labels on the mining codes ``z`` (n, d_sae; last-position SAE
    codes), per side (the label a latent is more often active on), in descending MI order: the first
    ``top`` of each side, or with ``mi_share`` the side's budget :func:`mi_budget` (App. C's K);
    each with its held-out frequency separation."""
    z, z_held = z.float().cpu(), z_held.float().cpu()   # small code matrices: mined on the CPU
    y = torch.tensor([l == MEMORY for l in label])
    if y.all() or (~y).all():
        return {MEMORY: [], TOOL: []}
    act = z > 0
    mi = mutual_information(act, y)
    f_mem = act[y].float().mean(0)
    f_tool = act[~y].float().mean(0)
    yh = torch.tensor([l == MEMORY for l in label_held]) if len(label_held) else torch.zeros(0, dtype=torch.bool)
    held_ok = bool(yh.any()) and bool((~yh).any())
    sep_h = (act_h := z_held > 0)[yh].float().mean(0) - act_h[~yh].float().mean(0) if held_ok else None
    order = torch.argsort(mi, descending=True)
    order = order[mi[order] > 0]
    out: dict[str, list[Feature]] = {}
    for side, on_side in ((MEMORY, f_mem > f_tool), (TOOL, f_tool > f_mem)):
        idx = order[on_side[order]].tolist()
        k = top if mi_share is None else mi_budget(mi[idx].tolist(), mi_share)
        feats = []
        for i in idx[:k]:
            on = z[:, i][act[:, i]]
            hs = float(sep_h[i]) if held_ok else None
            agrees = None if hs is None else ((hs > 0) if side == MEMORY else (hs < 0))
            feats.append(Feature(i, side, float(mi[i]), float(f_mem[i]), float(f_tool[i]),
                                 float(on.mean()) if len(on) else 0.0, hs, agrees))
        out[side] = feats
    return out


def feature_table(feats: dict[str, list[Feature]]) -> list[dict]:
    return [f.__dict__ | {"mi": round(f.mi, 5)} for side in (MEMORY, TOOL) for f in feats[side]]

