"""Figures: each function writes a non-empty PNG from small synthetic tables and rejects bad input."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from matplotlib import pyplot as plt

from memtoc.core import figures


def _scored(n=40, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for model in ("m1", "m2"):
        for i in range(n):
            for cond in ("tool_right", "tool_wrong"):
                mem_ok = rng.random() < 0.5
                cell = {("tool_right", True): "agree", ("tool_right", False): "tool_gold",
                        ("tool_wrong", True): "arb", ("tool_wrong", False): "both_wrong"}[(cond, mem_ok)]
                rows.append({"model": model, "condition": cond, "cell": cell, "arm": "untreated",
                             "frame": "schema", "formulation": "reference", "qkey": f"q{i}",
                             "followed_tool": bool(rng.random() < 0.7), "kept_memory": bool(rng.random() < 0.3)})
    return pd.DataFrame(rows)


def _png(path):
    b = path.read_bytes()
    assert b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) > 5000


def test_source_matrix_counts_and_png(tmp_path):
    d = _scored()
    t = figures.source_matrix_counts(d)
    assert len(t) == 8  # 2 models x 4 cells
    m1 = d[d["model"] == "m1"]
    arb = t[(t["model"] == "m1") & (t["cell"] == "arb")].iloc[0]
    ref = m1[m1["cell"] == "arb"]
    assert arb["n"] == len(ref) and arb["follow_rate"] == pytest.approx(ref["followed_tool"].mean())
    p = figures.source_matrix(d, tmp_path / "sub" / "m.png")
    _png(p)


def test_headline_and_tradeoffs_png(tmp_path):
    rows = []
    for f in ("reference", "paraphrase_a", "pooled"):
        for m, v in (("retention", 0.3), ("tool_follow", 0.8), ("wrong_follow", 0.9), ("err_abstain", None)):
            rows.append({"model": "m1", "formulation": f, "metric": m, "value": v,
                         "lo": None if v is None else v - 0.1, "hi": None if v is None else v + 0.05, "n": 10})
    _png(figures.headline(pd.DataFrame(rows), tmp_path / "h.png"))
    c = pd.DataFrame([{"model": "m1", "arm": a, "metric": m, "delta": d, "lo": d - 0.1, "hi": d + 0.1}
                      for a, d in (("warn", 0.1), ("prior", 0.3), ("flag", -0.05))
                      for m in ("retention", "tool_follow", "err_abstain")])
    _png(figures.prompting_tradeoffs(c, tmp_path / "t.png"))


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(figures.FigureError, match="empty"):
        figures.headline(pd.DataFrame(columns=["model", "formulation", "metric", "value", "lo", "hi"]), tmp_path / "x.png")
    with pytest.raises(figures.FigureError, match="lacks"):
        figures.prompting_tradeoffs(pd.DataFrame({"model": ["a"]}), tmp_path / "x.png")


def test_save_creates_folders_and_closes(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    n_before = len(plt.get_fignums())
    p = figures.save(fig, tmp_path / "a" / "b" / "c.png")
    assert p.is_file() and len(plt.get_fignums()) == n_before - 1


def test_a_metric_without_a_two_line_label_gets_the_registry_label():
    from memtoc.core import metrics
    extra = [m for m in metrics.METRICS if m not in figures.METRIC_LABELS]
    assert extra                                           # e.g. keep_flag, bw_gold
    for m in extra:
        assert figures.metric_label(m) == metrics.metric_spec(m).label != m
    assert figures.metric_label("retention") == figures.METRIC_LABELS["retention"]
    assert figures.metric_label("not_a_metric") == "not_a_metric"
