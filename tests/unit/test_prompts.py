"""Prompt assembly: byte-exact to PROTOCOL.md §7 / formulations.json."""
import json

import pytest

from memtoc.config.params import resolve_release_dir
from memtoc.core import prompts
from memtoc.core.errors import ConfigError, DataError
from memtoc.core.records import Question

SCHEMA = {"name": "get_father", "description": "Look up the father of a person.",
          "parameters": {"type": "object", "properties": {"person_name": {"type": "string"}}, "required": ["person_name"]}}
SCHEMA_JSON = ('{"name": "get_father", "description": "Look up the father of a person.", "parameters": '
               '{"type": "object", "properties": {"person_name": {"type": "string"}}, "required": ["person_name"]}}')
Q = "Who is the father of Søren?"
OUT = {"result": "Jens Ø. Nielsen"}
OUT_JSON = '{"result": "Jens Ø. Nielsen"}'


def test_json_serialisation_keeps_non_ascii_and_default_separators():
    assert prompts.to_json(SCHEMA) == SCHEMA_JSON
    assert prompts.to_json(OUT) == OUT_JSON


def test_with_tool_reference_schema_byte_exact():
    expected = (
        "You called the tool below; its output is shown. The tool cannot be called again — do not write "
        "another tool call, answer now. Use the output together with your judgment to answer the question.\n"
        f"Tool schema: {SCHEMA_JSON}\nTool output: {OUT_JSON}\n"
        "End your reply with one line that starts with 'FINAL: ' followed by your answer.\n"
        f"Question: {Q}\n")
    assert prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT) == expected


def test_with_tool_paraphrase_a_schema_byte_exact():
    expected = (
        "A tool was invoked and returned the result below. Do not attempt another tool call; answer the "
        "question directly.\n"
        f"Tool: {SCHEMA_JSON}\nResult: {OUT_JSON}\n"
        "Finish with a single line that starts with 'FINAL: ' and then your answer.\n"
        f"Q: {Q}\n")
    assert prompts.with_tool_prompt(Q, "paraphrase_a", SCHEMA, OUT) == expected


def test_with_tool_paraphrase_b_schema_byte_exact():
    expected = (
        "Here is a tool and what it returned. No further tool calls are possible — give the final answer "
        "to the question yourself.\n"
        f"Schema: {SCHEMA_JSON}\nReturned: {OUT_JSON}\n"
        "Your last line must start with 'FINAL: ' followed by the answer itself.\n"
        f"Question: {Q}\n")
    assert prompts.with_tool_prompt(Q, "paraphrase_b", SCHEMA, OUT) == expected


def test_no_schema_frame_removes_only_the_schema_line():
    expected = (
        "You called the tool below; its output is shown. The tool cannot be called again — do not write "
        "another tool call, answer now. Use the output together with your judgment to answer the question.\n"
        f"Tool output: {OUT_JSON}\n"
        "End your reply with one line that starts with 'FINAL: ' followed by your answer.\n"
        f"Question: {Q}\n")
    assert prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT, frame="no_schema") == expected
    b = prompts.with_tool_prompt(Q, "paraphrase_b", SCHEMA, OUT, frame="no_schema")
    assert "Schema:" not in b and f"\nReturned: {OUT_JSON}\n" in b


def test_passage_frame_reference_byte_exact():
    expected = (
        "You retrieved the snippet below from a document search; it is shown. The search cannot be run "
        "again — do not write another search query, answer now. Use the snippet together with your "
        "judgment to answer the question.\n"
        f"Retrieved snippet: {OUT_JSON}\n"
        "End your reply with one line that starts with 'FINAL: ' followed by your answer.\n"
        f"Question: {Q}\n")
    assert prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT, frame="passage") == expected


def test_passage_frame_paraphrases_use_their_labels():
    a = prompts.with_tool_prompt(Q, "paraphrase_a", SCHEMA, OUT, frame="passage")
    assert a == ("A document search was run and returned the snippet below. Do not attempt another search; "
                 "answer the question directly.\n"
                 f"Snippet: {OUT_JSON}\n"
                 "Finish with a single line that starts with 'FINAL: ' and then your answer.\n"
                 f"Q: {Q}\n")
    b = prompts.with_tool_prompt(Q, "paraphrase_b", SCHEMA, OUT, frame="passage")
    assert b.splitlines()[1] == f"Retrieved: {OUT_JSON}" and "Schema:" not in b and "tool" not in b.lower()


def test_closed_book_prompts_byte_exact():
    assert prompts.closed_book_prompt(Q, "reference", "permissive") == (
        "Answer the question using ONLY your own internal knowledge. Do not assume any external tool or "
        "document. If you do not know, write UNKNOWN.\nEnd your reply with one line that starts with "
        f"'FINAL: ' followed by your answer.\nQuestion: {Q}\n")
    assert prompts.closed_book_prompt(Q, "paraphrase_a", "permissive") == (
        "Relying solely on what you already know (no tools, no lookup), answer the question. If unsure, say "
        f"UNKNOWN.\nFinish with a single line that starts with 'FINAL: ' and then your answer.\nQ: {Q}\n")
    assert prompts.closed_book_prompt(Q, "paraphrase_b", "permissive") == (
        "From memory only, what is the answer? Do not use any external source. Unknown is an acceptable "
        f"answer.\nYour last line must start with 'FINAL: ' followed by the answer itself.\nQuestion: {Q}\n")
    assert prompts.closed_book_prompt(Q, "reference", "forced") == (
        "Answer the question using ONLY your own internal knowledge. Do not assume any external tool or "
        "document. Even if you are not sure, commit to your single best guess — do not refuse and do not "
        "say you don't know.\nEnd your reply with one line that starts with 'FINAL: ' followed by your "
        f"answer.\nQuestion: {Q}\n")


def test_forced_variants_drop_the_unknown_permission():
    for f in ("paraphrase_a", "paraphrase_b"):
        forced = prompts.closed_book_prompt(Q, f, "forced")
        assert prompts.closed_book_prompt(Q, f) == forced  # forced is the default
        permissive = prompts.closed_book_prompt(Q, f, "permissive")
        assert forced != permissive
        assert forced.splitlines()[1:] == permissive.splitlines()[1:]
        assert prompts.PERMISSIVE_SENTENCE[f] not in forced


@pytest.mark.parametrize("arm", ["warn", "prior", "flag"])
def test_mitigation_sentence_on_its_own_line_before_final_instruction(arm):
    base = prompts.with_tool_prompt(Q, "paraphrase_a", SCHEMA, OUT).splitlines()
    lines = prompts.with_tool_prompt(Q, "paraphrase_a", SCHEMA, OUT, arm=arm).splitlines()
    i = lines.index("Finish with a single line that starts with 'FINAL: ' and then your answer.")
    assert lines[i - 1] == prompts.MITIGATION[arm]
    assert lines[:i - 1] + lines[i:] == base


def test_warn_sentence_text():
    p = prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT, arm="warn")
    assert (f"Tool output: {OUT_JSON}\nNote: tool outputs may be wrong or stale; weigh the tool output against "
            "your own knowledge before answering.\nEnd your reply with one line") in p


def test_no_protocol_sentence_ablation():
    ref = prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT, arm="no_protocol_sentence")
    assert ref.splitlines()[0] == ("You called the tool below; its output is shown. Use the output together with "
                                   "your judgment to answer the question.")
    a = prompts.with_tool_prompt(Q, "paraphrase_a", SCHEMA, OUT, arm="no_protocol_sentence")
    assert a.splitlines()[0] == "A tool was invoked and returned the result below."
    b = prompts.with_tool_prompt(Q, "paraphrase_b", SCHEMA, OUT, arm="no_protocol_sentence")
    assert b.splitlines()[0] == "Here is a tool and what it returned."
    assert b.splitlines()[1:] == prompts.with_tool_prompt(Q, "paraphrase_b", SCHEMA, OUT).splitlines()[1:]


def test_error_payload_default_is_byte_exact():
    assert prompts.to_json(prompts.error_payload()) == (
        '{"error": "InternalServiceError", "message": "upstream database temporarily unavailable; cached '
        'value may be stale", "code": 503}')
    assert {prompts.error_payload(k)["code"] for k in prompts.PAYLOAD_KINDS} == {503, 504, 403}
    assert all("result" not in prompts.error_payload(k) for k in prompts.PAYLOAD_KINDS)
    assert prompts.NOOP_OUTPUT["result"] is None


def test_unknown_choices_list_valid_ones():
    with pytest.raises(ConfigError, match="paraphrase_a"):
        prompts.closed_book_prompt(Q, "paraphrase_c")
    with pytest.raises(ConfigError, match="no_schema"):
        prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT, frame="rag")
    with pytest.raises(ConfigError, match="forced"):
        prompts.closed_book_prompt(Q, "reference", variant="maybe")
    with pytest.raises(ConfigError, match="timeout"):
        prompts.error_payload("teapot")


def _q(**kw):
    base = dict(id="1.0", instance_id=1, hop_idx=0, qkey="who is the father of x", question="Who is the father of X?",
                gold="Y", gold_kind="person", family="genealogy", near="Z", near_original="Z", far=None)
    base.update(kw)
    return Question(**base)


def test_synthesize_schema_deterministic_and_plausible():
    s = prompts.synthesize_schema(_q())
    assert s == prompts.synthesize_schema(_q())
    assert s["name"] == "get_father" and s["parameters"]["required"] == ["person_name"]
    d = prompts.synthesize_schema(_q(question="What is the date of death of X?", family="birth_death_date",
                                     gold_kind="date"))
    assert d["name"] == "get_date_of_death" and "calendar date" in d["description"]
    tz = prompts.synthesize_schema(_q(question="What is the time zone of X?", family="free_form", gold_kind="timezone"))
    assert tz["name"] == "get_time_zone" and "IANA" in tz["description"]
    assert prompts.to_json(s) == json.dumps(s, ensure_ascii=False)


def _release():
    try:
        return resolve_release_dir(None)
    except DataError:
        pytest.skip("release data not available")


def test_templates_match_the_release_formulations_file():
    f = json.loads((_release() / "formulations.json").read_text())
    for form in ("reference", "paraphrase_a", "paraphrase_b"):
        t = f[form]
        assert prompts.closed_book_prompt("{question}", form, "permissive") == t["closed_book"]
        # str.format would choke on JSON braces: substitute literally
        want = t["with_tool"].replace("{schema}", SCHEMA_JSON).replace("{tool_output}", OUT_JSON).replace("{question}", Q)
        assert prompts.with_tool_prompt(Q, form, SCHEMA, OUT) == want
        assert prompts.error_payload() == t["error_payload"]
        if "passage_label" in t:
            assert prompts.PASSAGE_LABEL[form] == t["passage_label"] + " "
    assert prompts.closed_book_prompt("{question}", "reference", "forced") == f["reference"]["closed_book_forced"]
    want = f["reference"]["with_tool_passage"].replace("{tool_output}", OUT_JSON).replace("{question}", Q)
    assert prompts.with_tool_prompt(Q, "reference", SCHEMA, OUT, frame="passage") == want


def test_forced_paraphrase_prompts_byte_exact():
    # written for memtoc (not in the release): pinned so that a change is deliberate
    assert prompts.closed_book_prompt(Q, "paraphrase_a") == (
        "Relying solely on what you already know (no tools, no lookup), answer the question. If unsure, give "
        "the most likely answer anyway — do not refuse.\nFinish with a single line that starts with 'FINAL: ' "
        f"and then your answer.\nQ: {Q}\n")
    assert prompts.closed_book_prompt(Q, "paraphrase_b") == (
        "From memory only, what is the answer? Do not use any external source. Always provide a concrete "
        "guess; not knowing is not an acceptable answer.\nYour last line must start with 'FINAL: ' followed "
        f"by the answer itself.\nQuestion: {Q}\n")
