"""Episode builder: conditions, frames, arms, payloads, ids, I/O, run selection."""
import json
from collections import Counter

import pytest

from memtoc.config.params import FORMULATIONS, load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core import prompts
from memtoc.core.errors import ConfigError, DataError
from memtoc.core.records import Question
from memtoc.data import episodes as ep


def _q(i, far="Far Value", kind="person", **kw):
    d = dict(id=f"{i}.0", instance_id=i, hop_idx=0, qkey=f"who is the father of person {i}",
             question=f"Who is the father of Person {i}?", gold=f"Gold {i}", gold_kind=kind, family="genealogy",
             near=f"Near {i}", near_original=f"Old {i}", far=far, fold=i % 2)
    d.update(kw)
    return Question(**d)


QS = [_q(1), _q(2, far=None), _q(3, kind="year", gold="1950", near="1955", far="1700", family="free_form",
                               question="In what year was X born?")]


def test_core_conditions_values_and_prompts():
    eps = ep.build_episodes(QS, ["reference"], ep.CORE_CONDITIONS)
    assert len(eps) == 3 * 4
    by = {(e.question_id, e.condition): e for e in eps}
    r, w, er, nt = (by[("1.0", c)] for c in ("tool_right", "tool_wrong", "tool_error", "no_tool"))
    assert (r.tool_value, r.tool_correct, r.tool_output) == ("Gold 1", True, {"result": "Gold 1"})
    assert (w.tool_value, w.tool_correct, w.tool_output) == ("Near 1", False, {"result": "Near 1"})  # repaired near
    assert er.tool_value is None and er.tool_correct is False and er.tool_output == prompts.error_payload()
    assert er.payload_kind == "service_unavailable"
    assert nt.tool_output is None and nt.tool_correct is None and nt.schema_kind == "none"
    assert nt.prompt == prompts.closed_book_prompt("Who is the father of Person 1?", "reference", "forced")
    assert r.schema_kind == "synthesized" and r.schema == prompts.synthesize_schema(QS[0])
    assert r.prompt == prompts.with_tool_prompt(QS[0].question, "reference", r.schema, {"result": "Gold 1"})
    assert r.episode_id == "1-0-tool_right-v0" and r.fold == 1


def test_reference_episode_prompt_byte_exact():
    e = ep.build_episodes([QS[0]], ["reference"], ["tool_wrong"])[0]
    assert e.prompt == (
        "You called the tool below; its output is shown. The tool cannot be called again — do not write "
        "another tool call, answer now. Use the output together with your judgment to answer the question.\n"
        'Tool schema: {"name": "get_father", "description": "Look up the father of a person in a genealogical '
        "knowledge base. Returns the person's full name.\", \"parameters\": {\"type\": \"object\", \"properties\": "
        '{"person_name": {"type": "string", "description": "Full name of the person whose father is requested."}}, '
        '"required": ["person_name"]}}\n'
        'Tool output: {"result": "Near 1"}\n'
        "End your reply with one line that starts with 'FINAL: ' followed by your answer.\n"
        "Question: Who is the father of Person 1?\n")


def test_far_only_where_a_far_value_exists():
    eps = ep.build_episodes(QS, FORMULATIONS, ["tool_far"])
    assert {e.question_id for e in eps} == {"1.0", "3.0"} and len(eps) == 6
    assert all(e.tool_value == "Far Value" or e.tool_value == "1700" for e in eps)
    assert all(e.tool_correct is False for e in eps)


def test_frames_apply_to_value_conditions_only():
    eps = ep.build_episodes(QS[:1], ["paraphrase_a"], ep.ALL_CONDITIONS, frames=ep.FRAMES)
    c = Counter((e.condition, e.frame) for e in eps)
    for cond in ("tool_right", "tool_wrong", "tool_far"):
        assert all(c[(cond, f)] == 1 for f in ep.FRAMES)
    for cond in ("tool_error", "no_tool", "noop"):
        assert c[(cond, "schema")] == 1 and c[(cond, "passage")] == 0 and c[(cond, "no_schema")] == 0
    passage = next(e for e in eps if e.frame == "passage" and e.condition == "tool_right")
    assert "Snippet: {\"result\": \"Gold 1\"}" in passage.prompt and "Tool:" not in passage.prompt


def test_payload_kinds_and_noop():
    eps = ep.build_episodes(QS[:1], ["reference"], ["tool_error", "noop", "tool_right"], payload_kinds=ep.PAYLOAD_KINDS)
    errs = [e for e in eps if e.condition == "tool_error"]
    assert [e.payload_kind for e in errs] == list(ep.PAYLOAD_KINDS)
    assert [e.episode_id for e in errs] == ["1-0-tool_error-v0", "1-0-tool_error-v0-timeout",
                                           "1-0-tool_error-v0-permission_denied"]
    assert len([e for e in eps if e.condition == "tool_right"]) == 1  # payload kinds only multiply tool_error
    noop = next(e for e in eps if e.condition == "noop")
    assert noop.tool_value is None and noop.tool_correct is None and noop.tool_output["result"] is None
    assert '"result": null' in noop.prompt


def test_arms_and_unique_stable_ids():
    eps = ep.build_episodes(QS, ["reference", "paraphrase_a", "paraphrase_b"], ep.ALL_CONDITIONS,
                            frames=ep.FRAMES, arms=ep.ARMS, payload_kinds=ep.PAYLOAD_KINDS)
    ids = [e.episode_id for e in eps]
    assert len(ids) == len(set(ids))
    again = ep.build_episodes(QS, ["reference", "paraphrase_a", "paraphrase_b"], ep.ALL_CONDITIONS,
                              frames=ep.FRAMES, arms=ep.ARMS, payload_kinds=ep.PAYLOAD_KINDS)
    assert [e.episode_id for e in again] == ids and [e.prompt for e in again] == [e.prompt for e in eps]
    warn = next(e for e in eps if e.arm == "warn" and e.condition == "tool_wrong" and e.formulation == "reference"
                and e.frame == "schema")
    assert warn.episode_id == "1-0-tool_wrong-v0-warn" and prompts.MITIGATION["warn"] in warn.prompt
    nt = [e for e in eps if e.condition == "no_tool" and e.question_id == "1.0" and e.formulation == "reference"]
    assert len({e.prompt for e in nt}) == 1  # arms do not touch the closed-book prompt


def test_unknown_choices_raise_config_error_listing_valid_ones():
    with pytest.raises(ConfigError, match="tool_right, tool_wrong, tool_far"):
        ep.build_episodes(QS, ["reference"], ["tool_maybe"])
    with pytest.raises(ConfigError, match="reference, paraphrase_a, paraphrase_b"):
        ep.build_episodes(QS, ["paraphrase_z"], ["tool_right"])
    with pytest.raises(ConfigError, match="passage"):
        ep.build_episodes(QS, ["reference"], ["tool_right"], frames=["snippet"])
    with pytest.raises(ConfigError, match="no_protocol_sentence"):
        ep.build_episodes(QS, ["reference"], ["tool_right"], arms=["shout"])


def test_duplicate_questions_rejected():
    with pytest.raises(DataError, match="duplicate"):
        ep.build_episodes([QS[0], QS[0]], ["reference"], ["tool_right"])


def test_write_read_roundtrip(tmp_path):
    eps = ep.build_episodes(QS, ["paraphrase_b"], ep.ALL_CONDITIONS, payload_kinds=ep.PAYLOAD_KINDS)
    path = ep.write_episodes(eps, tmp_path / "episodes" / "paraphrase_b.jsonl")
    assert ep.read_episodes(path) == eps
    assert "Søren" in ep.write_episodes([ep.build_episodes([_q(9, question="Søren?")], ["reference"], ["no_tool"])[0]],
                                        tmp_path / "x.jsonl").read_text(encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().splitlines()[0] + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2"):
        ep.read_episodes(bad)
    bad.write_text(json.dumps({"episode_id": "x"}) + "\n")
    with pytest.raises(DataError, match="line 1: missing field"):
        ep.read_episodes(bad)
    with pytest.raises(DataError, match="does not exist"):
        ep.read_episodes(tmp_path / "none.jsonl")


class _FakeBench:
    def __init__(self, qs):
        self.analysis = qs


def test_run_episodes_headline_and_extras():
    qs = [_q(i, far=("F" if i % 3 else None)) for i in range(1, 21)]
    P = load_params(None, {"n_questions": 8, "n_questions_extra": 3, "formulations": ["reference", "paraphrase_a"]})
    eps = ep.run_episodes(_FakeBench(qs), RunConfig.of(P))
    ids = [e.episode_id for e in eps]
    assert len(ids) == len(set(ids))
    core = [e for e in eps if e.arm == "untreated" and e.frame == "schema" and e.condition in ep.CORE_CONDITIONS
            and e.payload_kind in (None, "service_unavailable")]
    assert len(core) == 8 * 4 * 2
    head = {e.qkey for e in core}
    extra = {e.qkey for e in eps if e not in core}
    assert extra <= head and len(extra) == 3
    kinds = Counter((e.condition, e.frame, e.arm, e.payload_kind) for e in eps if e not in core)
    assert kinds[("noop", "schema", "untreated", None)] == 3 * 2
    assert kinds[("tool_error", "schema", "untreated", "timeout")] == 3 * 2
    assert kinds[("tool_wrong", "passage", "untreated", None)] == 3 * 2
    assert kinds[("tool_wrong", "schema", "flag", None)] == 3 * 2
    assert kinds[("tool_error", "schema", "no_protocol_sentence", "service_unavailable")] == 3 * 2
    P2 = load_params(None, {"n_questions": 8, "n_questions_extra": 3, "extra_arms": ["far"]})
    eps2 = ep.run_episodes(_FakeBench(qs), RunConfig.of(P2))
    assert {e.condition for e in eps2} == set(ep.CORE_CONDITIONS) | {"tool_far"}
    # extras beyond the headline still get their untreated baseline
    P3 = load_params(None, {"n_questions": 2, "n_questions_extra": 4, "extra_arms": ["noop"], "formulations": ["reference"]})
    eps3 = ep.run_episodes(_FakeBench(qs), RunConfig.of(P3))
    noop_q = {e.qkey for e in eps3 if e.condition == "noop"}
    assert noop_q <= {e.qkey for e in eps3 if e.condition == "tool_wrong"} and len(noop_q) == 4
