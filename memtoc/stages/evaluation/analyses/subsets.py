"""The episodes an analysis reads: one arm and frame of a scored frame, the formulations present,
a question subset."""
from __future__ import annotations

from typing import Iterable, Sequence

import pandas as pd

from memtoc.core.vocab import BASELINE_ARM, DEFAULT_FRAME, DEFAULT_PAYLOAD, FORMULATIONS


def select_arm(df: pd.DataFrame, arm: str = BASELINE_ARM, frame: str = DEFAULT_FRAME,
               payload_kind: str | None = DEFAULT_PAYLOAD, conditions: Sequence[str] | None = None) -> pd.DataFrame:
    """Episodes of one arm and frame; tool_error episodes only of ``payload_kind`` (None: all)."""
    m = (df["arm"] == arm) & (df["frame"] == frame)
    if payload_kind is not None:
        m &= (df["condition"] != "tool_error") | (df["payload_kind"].fillna(DEFAULT_PAYLOAD) == payload_kind)
    if conditions is not None:
        m &= df["condition"].isin(conditions)
    return df[m]


def present_formulations(df: pd.DataFrame, formulations: Sequence[str] | None) -> list[str]:
    """The formulations of ``formulations`` (None: every one, in the paper's order) that ``df`` holds."""
    present = set(df["formulation"].unique()) if len(df) else set()
    order = list(formulations or FORMULATIONS)
    return [f for f in order if f in present]


def restrict_questions(df: pd.DataFrame, qkeys: Iterable[str]) -> pd.DataFrame:
    """The episodes of ``df`` whose question is in ``qkeys``."""
    return df[df["qkey"].isin(set(qkeys))]
