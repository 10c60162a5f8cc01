"""The agent loop without a model: parsers, tool validation, the protocol state machines against a
scripted runtime (every termination and mechanism class; an answer that agrees without calling),
metrics, server capability refusal, and trace resume after a SIGKILL."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.stages.agent import core, metrics, parsers, protocols, runtime, tools, traces
from memtoc.stages.agent.parsers import FORMATS, ToolCall
from memtoc.stages.agent.protocols import EpisodeSpec, run_episodes
from memtoc.stages.agent.runtime import ChatRequest, ChatResponse, OpenAIRuntime, ProtocolUnsupported, Runtime

SCHEMA = {"name": "find_person", "description": "Look up a person.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "q"}},
                         "required": ["query"]}}
TYPED = {"name": "find_person", "description": "Look up a person.",
         "parameters": {"type": "object", "properties": {
             "query": {"type": "string"}, "exact_match": {"type": "boolean"},
             "max_results": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["query"]}}
SMOL = FORMATS["smollm2"]


# ================================================================================================
# parsers

def test_smollm2_format_parses_lists_objects_empty_and_broken_calls():
    p = SMOL.parse('<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>')
    assert p.opened and p.error is None and [(c.name, c.arguments) for c in p.calls] == [("f", {"a": 1})]
    p = SMOL.parse('Let me look. <tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call> done')
    assert p.calls[0].arguments == {"a": 2} and p.content == "Let me look.  done"
    p = SMOL.parse("<tool_call>[]</tool_call>")
    assert p.opened and p.calls == [] and p.error is None
    p = SMOL.parse('<tool_call>[{"name": "f", "arguments": {"a": </tool_call>')
    assert p.opened and p.error and "not JSON" in p.error and not p.calls
    p = SMOL.parse('<tool_call>[{"name": "f", "arguments": {}}]')          # cut before the close tag
    assert p.calls and p.calls[0].name == "f"
    p = SMOL.parse('<tool_call>[{"arguments": {}}]</tool_call>')
    assert p.error and "name" in p.error
    assert SMOL.parse("FINAL: Paris").calls == [] and not SMOL.parse("FINAL: Paris").opened
    assert SMOL.parse(SMOL.render_call("f", {"q": "x"})).calls[0].arguments == {"q": "x"}


def test_native_family_formats():
    h = FORMATS["hermes"]
    p = h.parse('<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "g", "arguments": {}}\n</tool_call>')
    assert [c.name for c in p.calls] == ["f", "g"]
    assert h.parse("<tool_call>\n{oops}\n</tool_call>").error
    ll = FORMATS["llama3_json"]
    assert ll.parse('{"name": "f", "parameters": {"q": "x"}}').calls[0].arguments == {"q": "x"}
    assert ll.parse('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}').calls[1].name == "g"
    assert ll.parse('{"name": "f", "parameters": {"q": ').error                    # a call that does not parse: T2
    assert not ll.parse('{"answer": 3} is my guess').opened                        # merely starts with "{"
    assert ll.parse("The answer is 3.").calls == []
    m = FORMATS["mistral"]
    assert m.parse('[TOOL_CALLS] [{"name": "f", "arguments": {"q": 1}}]').calls[0].arguments == {"q": 1}
    assert m.parse('[{"name": "f", "arguments": {}}]').calls[0].name == "f"       # control token decoded away
    assert m.parse("[TOOL_CALLS] [{'name': 'f'}]").error
    for f in FORMATS.values():                                                     # begin + JSON + end parses back
        assert f.parse(f.begin("f") + '{"q": "x"}' + f.end()).calls[0].arguments == {"q": "x"}


def test_format_selection():
    assert parsers.format_for(["qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct"], True, "", True).name == "hermes"
    assert parsers.format_for(["llama-3.1-8b-instruct"], True, "", True).name == "llama3_json"
    assert parsers.format_for(["mistral-7b-instruct-v0.3"], True, "", True).name == "mistral"
    assert parsers.format_for(["smollm2-135m-instruct"], True, "x", False).name == "smollm2"
    assert parsers.format_for(["gemma-3-270m"], False).name == "smollm2"            # base model: raw transcript
    assert parsers.format_for(["gemma-2-9b-it"], True, "no tools", False).name == "smollm2"
    assert parsers.format_for(["mine"], True, "{{ '<tool_call>' }} tools", True).name == "hermes"


# ================================================================================================
# tools

def test_validation_counts_type_errors_and_coercion():
    assert tools.validate_call("find_person", {"query": "x"}, SCHEMA).ok
    assert tools.validate_call("find_person", '{"query": "x"}', SCHEMA).ok
    c = tools.validate_call("other", {"query": "x"}, SCHEMA)
    assert not c.ok and c.kind == "wrong_name"
    c = tools.validate_call("find_person", "not json", SCHEMA)
    assert not c.ok and c.kind == "not_object"
    c = tools.validate_call("find_person", {"query": "x", "exact_match": "true", "max_results": "3"}, TYPED)
    assert not c.ok and c.kind == "schema" and c.type_errors == 2 and c.coercible == 2
    c = tools.validate_call("find_person", {"query": 5, "max_results": 9}, TYPED)
    assert c.type_errors == 1 and c.coercible == 0 and len(c.errors) == 2       # + maximum
    c = tools.validate_call("find_person", {}, SCHEMA)
    assert not c.ok and c.type_errors == 0 and "required" in c.errors[0]


def test_typed_schema_oracle_and_fixture_tool():
    from memtoc.core.records import Question
    q = Question("1.0", 1, 0, "k", "Who is the father of X?", "Y", "person", "genealogy", "Z", "Z", None)
    s1, k1 = tools.episode_schema(q, "release")
    s2, k2 = tools.episode_schema(q, "typed")
    assert k1 == "synthesized" and k2 == "typed_memtoc" and s2 == tools.typed_schema(q)
    assert s2["name"] == s1["name"] and s2["parameters"]["required"] == s1["parameters"]["required"]
    types = {v["type"] for v in s2["parameters"]["properties"].values()}
    assert {"string", "boolean", "integer"} <= types
    assert tools.oracle_arguments(s2, q.question) == {s1["parameters"]["required"][0]: q.question}
    assert tools.validate_call(s2["name"], tools.oracle_arguments(s2, q.question), s2).ok
    assert tools.oracle_value({"type": "object", "properties": {"a": {"enum": ["u", "v"]}, "b": {"type": "boolean"},
                                                                "n": {"type": "integer"}},
                               "required": ["a", "b", "n"]}, "q") == {"a": "u", "b": False, "n": 0}
    r = tools.FixtureTool(SCHEMA, {"result": "Zoë", "b": 1}).execute({"anything": 1})
    assert r.content == '{"b":1,"result":"Zoë"}' and r.status == "ok" and len(r.sha256) == 64
    assert tools.FixtureTool(SCHEMA, {"error": "x"}).execute().status == "recoverable_error"


# ================================================================================================
# the loop against a scripted runtime

def spec(protocol: str, question: str = "Who is X?", schema=SCHEMA, tool_value="Jane Doe", **kw) -> EpisodeSpec:
    base = dict(model="m", protocol=protocol, formulation="reference", schema_variant="release",
                schema_kind="synthesized", question_id=question, qkey=question.lower(), instance_id=1,
                question=question, gold="John Roe", gold_kind="person", condition="tool_wrong",
                tool_value=tool_value, observation={"result": tool_value}, schema=schema, memory_span="John Roe",
                memory_correct=True, mem_absent=False, max_calls=1, max_tokens_per_call=64,
                max_tokens_per_episode=192)
    base.update(kw)
    return EpisodeSpec(**base)


def reply(text: str, n: int = 5, tool_choice="auto") -> ChatResponse:
    p = runtime.parse_reply(SMOL, text, tool_choice)
    return ChatResponse(text, p.content, p.calls, p.error, p.opened, 10, n, "stop")


CALL = '<tool_call>[{"name": "find_person", "arguments": {"query": "X"}}]</tool_call>'


class Scripted(Runtime):
    """Replies from ``script(request, turn_of_that_question) -> text | ChatResponse``; records requests."""
    kind = "scripted"
    named_tool_choice = constrained = True
    enforces_none = False

    def __init__(self, script):
        self.script = script
        self.seen: list[tuple[str, str]] = []          # (question, tool_choice) per request
        self.turns: dict[str, int] = {}

    def chat_many(self, requests):
        out = []
        for r in requests:
            q = next(m["content"] for m in r.messages if m["role"] == "user").split("\n")[0]
            self.turns[q] = self.turns.get(q, 0) + 1
            self.seen.append((q, json.dumps(r.tool_choice)))
            got = self.script(r, self.turns[q])
            out.append(got if isinstance(got, ChatResponse) else reply(got))      # "none" not enforced
        return out


def run_one(s: EpisodeSpec, script, tmp_path, rt=None):
    rt = rt or Scripted(script)
    res = run_episodes(rt, [s], traces.Trace(tmp_path / f"{s.protocol}-{abs(hash(s.key))}.jsonl"))
    return res["records"][0], rt


def test_auto_call_then_final_agrees_and_executes(tmp_path):
    rec, rt = run_one(spec("auto"), lambda r, t: CALL if t == 1 else "It is Jane.\nFINAL: Jane Doe", tmp_path)
    assert rec["termination"] == "final" and rec["executed"] and rec["agreement"] and not rec["kept_memory"]
    assert not any(rec["mechanisms"].values()) and rec["type_errors"] == [0] and rec["turns"] == 2
    assert [c for _, c in rt.seen] == ['"auto"', '"none"']                         # after the call: none


def test_answer_without_calling_agrees_but_does_not_execute(tmp_path):
    """The paper's metric caveat: agreement 1.0 with execution 0.0."""
    recs = []
    for q in ("Who is A?", "Who is B?"):
        r, _ = run_one(spec("auto", question=q), lambda r, t: "FINAL: Jane Doe", tmp_path)
        recs.append(r)
    df = metrics.episodes_frame(recs)
    block = metrics.protocol_block(df, ["reference"], n_boot=200)
    assert block["answer_agreement"]["pooled"]["value"] == 1.0
    assert block["tool_execution_rate"]["pooled"]["value"] == 0.0
    assert block["agreement_minus_execution"]["pooled"]["value"] == 1.0
    assert block["answer_agreement"]["reference"]["n"] == 2 and block["answer_agreement"]["reference"]["ci95"]
    assert block["terminations"]["final"]["count"] == 2 and block["mechanisms"]["T4"]["count"] == 2


def test_unparseable_call_is_t2(tmp_path):
    rec, _ = run_one(spec("auto"), lambda r, t: '<tool_call>[{"name": "find_person", "arguments": {query}]</tool_call>',
                     tmp_path)
    assert rec["termination"] == "invalid_call" and rec["mechanisms"]["T2"] and not rec["executed"]
    assert not rec["mechanisms"]["T4"] and rec["n_call_attempts"] == 1


def test_arguments_not_an_object_are_t2(tmp_path):
    rec, _ = run_one(spec("auto"), lambda r, t: '<tool_call>[{"name": "find_person", "arguments": "X"}]</tool_call>',
                     tmp_path)
    assert rec["termination"] == "invalid_call" and rec["mechanisms"]["T2"]


def test_type_coercion_is_t1_with_per_call_counts(tmp_path):
    bad = '<tool_call>[{"name": "find_person", "arguments": {"query": "X", "exact_match": "true", "max_results": "2"}}]</tool_call>'
    rec, _ = run_one(spec("auto", schema=TYPED), lambda r, t: bad, tmp_path)
    assert rec["termination"] == "invalid_call" and rec["mechanisms"]["T1"] and not rec["mechanisms"]["T2"]
    assert rec["type_errors"] == [2] and rec["n_type_errors"] == 2 and rec["coercible"] == 2
    block = metrics.protocol_block(metrics.episodes_frame([rec]), ["reference"], n_boot=50)
    assert block["type_errors"]["total"] == 2 and block["type_errors"]["per_call_mean"] == 2.0


def test_other_invalid_calls(tmp_path):
    rec, _ = run_one(spec("auto"), lambda r, t: CALL.replace("find_person", "find_place"), tmp_path)
    assert rec["termination"] == "invalid_call" and rec["mechanisms"]["other_invalid"]
    two = '<tool_call>[{"name": "find_person", "arguments": {"query": "X"}}, {"name": "find_person", "arguments": {"query": "Y"}}]</tool_call>'
    rec, _ = run_one(spec("auto", question="Who is Q?"), lambda r, t: two, tmp_path)
    assert rec["termination"] == "invalid_call" and rec["mechanisms"]["other_invalid"] and rec["n_call_attempts"] == 2


def test_guided_without_a_call_is_invalid_call_as_protocol_s8(tmp_path):
    """PROTOCOL §8: "assistant message with no tool calls -> final ... Exception: a1 with a tool
    available but no call made yet -> invalid_call" (a1 = guided; two_stage after YES forces the same call)."""
    rec, rt = run_one(spec("guided"), lambda r, t: "FINAL: Jane Doe", tmp_path)
    assert rec["termination"] == "invalid_call" and "PROTOCOL §8" in rec["why"]
    assert rec["mechanisms"]["T4"] and not rec["mechanisms"]["other_invalid"] and not rec["agreement"]
    assert json.loads(rt.seen[0][1]) == {"type": "function", "function": {"name": "find_person"}}
    rec, _ = run_one(spec("two_stage", question="Who is Y?"), lambda r, t: "YES" if t == 1 else "FINAL: Jane Doe",
                     tmp_path)
    assert rec["decision"] == "yes" and rec["termination"] == "invalid_call" and rec["mechanisms"]["T4"]
    rec, _ = run_one(spec("auto", question="Who is Z?"), lambda r, t: "FINAL: Jane Doe", tmp_path)
    assert rec["termination"] == "final" and rec["agreement"]                     # a2 (auto): a final answer
    assert protocols.TERMINATIONS == ("final", "invalid_call", "max_calls", "max_tokens")
    assert spec("guided").termination_rules == "protocol-s8"                      # older traces' episodes re-run


def test_a_call_after_the_budget_is_max_calls(tmp_path):
    rec, _ = run_one(spec("guided"), lambda r, t: CALL, tmp_path)          # the runtime ignores "none"
    assert rec["termination"] == "max_calls" and rec["n_calls_executed"] == 1 and rec["executed"]


def test_token_budget_is_max_tokens(tmp_path):
    rec, _ = run_one(spec("auto", max_tokens_per_episode=64),
                     lambda r, t: reply(CALL, n=40) if t == 1 else reply("FINAL: Jane Doe", n=30), tmp_path)
    assert rec["termination"] == "max_tokens" and rec["tokens"] == 70 and rec["executed"] and not rec["agreement"]


def test_per_call_limit_shrinks_with_the_episode_budget(tmp_path):
    limits = []

    def script(r, t):
        limits.append(r.max_tokens)
        return reply(CALL, n=50) if t == 1 else "FINAL: Jane Doe"
    run_one(spec("auto", max_tokens_per_call=64, max_tokens_per_episode=80), script, tmp_path)
    assert limits == [64, 30]


def test_two_stage_paths_and_t3(tmp_path):
    def script(r, t):
        if t == 1:
            return "Yes, I will call it."
        return CALL if t == 2 else "FINAL: Jane Doe"
    rec, rt = run_one(spec("two_stage"), script, tmp_path)
    assert rec["decision"] == "yes" and rec["executed"] and rec["termination"] == "final" and rec["agreement"]
    assert [json.loads(c) for _, c in rt.seen][:2] == ["none", {"type": "function", "function": {"name": "find_person"}}]
    rec, _ = run_one(spec("two_stage", question="Who is N?"), lambda r, t: "no" if t == 1 else "FINAL: John Roe", tmp_path)
    assert rec["decision"] == "no" and rec["mechanisms"]["T4"] and rec["kept_memory"] and not rec["executed"]
    rec, _ = run_one(spec("two_stage", question="Who is M?"), lambda r, t: "maybe later" if t == 1 else "FINAL: x",
                     tmp_path)
    assert rec["decision"] is None and rec["mechanisms"]["T3"] and not rec["mechanisms"]["T4"]
    assert rec["termination"] == "final"
    assert protocols.parse_decision("**NO**.") == "no" and protocols.parse_decision("I think yes") is None


def test_oracle_injects_a_valid_call_or_ends_invalid(tmp_path):
    rec, rt = run_one(spec("oracle"), lambda r, t: "FINAL: Jane Doe", tmp_path)
    assert rec["executed"] and rec["agreement"] and rec["termination"] == "final" and not rec["mechanisms"]["T4"]
    assert rt.seen == [("Who is X?", '"none"')]                               # only the answer turn
    strict = {"name": "find_person", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}}, "required": ["n"]}}
    rec, rt = run_one(spec("oracle", question="Who is O?", schema=strict), lambda r, t: "x", tmp_path)
    assert rec["termination"] == "invalid_call" and rt.seen == []


def test_auto_constrained_asks_for_the_grammar(tmp_path):
    rec, rt = run_one(spec("auto_constrained"), lambda r, t: CALL if t == 1 else "FINAL: Jane Doe", tmp_path)
    assert rec["executed"] and rec["agreement"]


def test_repair_delta_and_summary_layout(tmp_path):
    recs = []
    for i in range(4):
        q = f"Who is {i}?"
        recs.append(run_one(spec("auto", question=q), lambda r, t: "FINAL: nobody", tmp_path)[0])
        recs.append(run_one(spec("auto_constrained", question=q),
                            lambda r, t: CALL if t == 1 else "FINAL: Jane Doe", tmp_path)[0])
    df = metrics.episodes_frame(recs)
    s = metrics.summarize_model(df, ["reference"], n_boot=200, n_perm=200)
    rep = s["all"]["release"]["repair"]
    assert rep["answer_agreement"]["delta"] == 1.0 and rep["tool_execution_rate"]["delta"] == 1.0
    assert rep["answer_agreement"]["n_units"] == 4
    assert s["memory_right"]["release"]["protocols"]["auto"]["n_episodes"] == 4
    summary = {"models": {"m": {"slices": s}}}
    tab = metrics.summary_table(summary)
    assert set(tab["protocol"]) == {"auto", "auto_constrained"} and len(metrics.repair_table(summary)) == 2
    fig = core.plot(summary, tmp_path / "f.png")
    assert fig.stat().st_size > 5000


# ================================================================================================
# servers: refuse what would silently degrade

def test_server_refuses_protocols_it_cannot_honour():
    rt = OpenAIRuntime("smollm2-135m-instruct", base_url="http://127.0.0.1:9/v1", server="transformers")
    rt.check_protocols(["auto", "oracle"])
    with pytest.raises(ProtocolUnsupported, match="guided.*transformers serve ignores it"):
        rt.check_protocols(["auto", "guided"])
    with pytest.raises(ProtocolUnsupported, match="auto_constrained"):
        rt.check_protocols(["auto_constrained"])
    q = OpenAIRuntime("qwen2.5-7b-instruct", base_url="http://127.0.0.1:9/v1", server="transformers")
    with pytest.raises(ProtocolUnsupported, match="two_stage"):
        q.check_protocols(["two_stage"])
    req = ChatRequest([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                      [tools.function_tool(SCHEMA)], runtime.named_choice("find_person"), 32)
    assert "tool_choice" not in q.request_body(req)[1] and q.request_body(req)[1]["tools"]
    v = OpenAIRuntime("qwen2.5-7b-instruct", base_url="http://127.0.0.1:9/v1", server="vllm")
    v.check_protocols(["guided", "auto", "two_stage", "oracle"])
    assert v.request_body(req)[1]["tool_choice"] == runtime.named_choice("find_person")
    body = rt.request_body(req)[1]                                # SmolLM2: memtoc renders the tools
    assert "tools" not in body and "<tools>" in body["messages"][0]["content"]
    g = OpenAIRuntime("gemma-3-270m", base_url="http://127.0.0.1:9/v1", server="vllm")
    path, body = g.request_body(req)
    assert path == "/completions" and body["prompt"].endswith("Assistant:") and "\nUser:" in body["stop"]


def test_server_tool_calls_are_read_and_none_is_not_trusted():
    v = OpenAIRuntime("qwen2.5-7b-instruct", base_url="http://127.0.0.1:9/v1", server="vllm")
    data = {"choices": [{"message": {"content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"q": "x"}'}}]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    r = v.response_from(data, ChatRequest([], None, "auto", 8))
    assert r.calls[0].arguments == {"q": "x"} and r.n_new_tokens == 4
    t = OpenAIRuntime("smollm2-135m-instruct", base_url="http://127.0.0.1:9/v1", server="transformers")
    data = {"choices": [{"message": {"content": CALL}, "finish_reason": "stop"}]}
    assert t.response_from(data, ChatRequest([], None, "none", 8)).calls         # "none" not enforced: a call


# ================================================================================================
# rendering

def test_text_format_rendering_and_raw_transcript():
    msgs = [{"role": "system", "content": protocols.system_prompt("reference")},
            {"role": "user", "content": "Who is X?"},
            runtime.assistant_call_message("", [ToolCall("find_person", {"query": "X"})], None),
            {"role": "tool", "tool_call_id": "call00000", "name": "find_person", "content": '{"result":"Jane"}'}]
    tm = runtime.text_messages(msgs, [tools.function_tool(SCHEMA)], SMOL)
    assert tm[0]["role"] == "system" and tm[0]["content"].startswith(protocols.AGENT_SYSTEM)
    assert '<tools>[{"type": "function", "function": {"name": "find_person"' in tm[0]["content"]
    assert tm[2] == {"role": "assistant", "content": SMOL.render_call("find_person", {"query": "X"})}
    assert tm[3] == {"role": "user", "content": '<tool_response>\n{"result":"Jane"}\n</tool_response>'}
    raw = runtime.raw_transcript(msgs, [tools.function_tool(SCHEMA)], SMOL)
    assert raw.endswith("\nAssistant:") and "\nUser: Who is X?\nAssistant: <tool_call>" in raw
    assert protocols.system_prompt("paraphrase_a").endswith("Finish with a single line that starts with 'FINAL: ' "
                                                             "and then your answer.".replace("Finish", "finish"))
    assert len(runtime.call_id(3)) == 9 and runtime.call_id(3).isalnum()


# ================================================================================================
# parameters

def test_agent_params_defaults_and_errors():
    P = load_params(None, overrides={"agent": {"n_questions": 3, "protocols": ["auto", "guided"]}})
    a = RunConfig.of(P).agent
    assert a["protocols"] == ["guided", "auto"] and a["models"] == P["models"] and a["n_boot"] == P["n_boot"]
    assert a["formulations"] == P["formulations"] and a["max_tokens_per_episode"] == 1536
    for bad, field in (({"protocols": ["fast"]}, "agent.protocols"), ({"models": ["other"]}, "agent.models"),
                       ({"max_tokens_per_call": 0}, "agent.max_tokens_per_call"), ({"bogus": 1}, "bogus"),
                       ({"max_tokens_per_call": 64, "max_tokens_per_episode": 32}, "agent.max_tokens_per_episode"),
                       ({"runtime": "vllm"}, "agent.runtime")):
        with pytest.raises(ConfigError, match=field):
            RunConfig.of(load_params(None, overrides={"agent": bad})).agent


def test_shipped_params_have_valid_agent_blocks():
    from memtoc.core.project import REPO_ROOT
    for f in ("default.yaml", "full.yaml", "paper.yaml", "smoke.yaml", "agent.yaml"):
        a = RunConfig.of(load_params(REPO_ROOT / "params" / f), f).agent
        assert a["protocols"], f


# ================================================================================================
# traces: a SIGKILL mid-run, then a resume that re-runs only the unfinished episodes

KILLER = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_agent import Scripted, spec, CALL
    from memtoc.stages.agent.protocols import run_episodes
    from memtoc.stages.agent.traces import Trace
    specs = [spec("auto", question=f"Who is A{{i}}?") for i in range(3)] + \\
            [spec("guided", question=f"Who is G{{i}}?") for i in range(3)]
    def script(r, t):
        if r.tool_choice == "none":            # round 2: the guided answers -> die in the middle of it
            os.kill(os.getpid(), signal.SIGKILL)
        return "FINAL: Jane Doe" if r.tool_choice == "auto" else CALL
    run_episodes(Scripted(script), specs, Trace({path!r}))
""")


def test_resume_after_sigkill_reruns_only_unfinished_episodes(tmp_path):
    path = tmp_path / "traces.jsonl"
    code = KILLER.format(tests=str(Path(__file__).parent), path=str(path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    tr = traces.Trace(path)
    events, _ = tr.read_events()
    assert {e["episode_id"].split("|")[0] for e in events if e["event"] == "termination"} == {f"Who is A{i}?" for i in range(3)}
    assert any(e["event"] == "execution" for e in events)              # the guided calls ran before the kill
    with open(path, "a") as f:
        f.write('{"event": "response", "episode": "torn')              # a torn last line as well
    specs = [spec("auto", question=f"Who is A{i}?") for i in range(3)] + \
            [spec("guided", question=f"Who is G{i}?") for i in range(3)]
    rt = Scripted(lambda r, t: CALL if r.tool_choice != "none" else "FINAL: Jane Doe")
    res = run_episodes(rt, specs, traces.Trace(path))
    assert res["ran"] == 3 and res["resume"]["finished"] == 3 and res["resume"]["dropped_episodes"] == 3
    assert res["resume"]["torn_lines"] == 1
    assert {q for q, _ in rt.seen} == {f"Who is G{i}?" for i in range(3)}   # finished episodes never re-run
    assert [r["termination"] for r in res["records"]] == ["final"] * 6
    assert [r["agreement"] for r in res["records"]] == [True] * 6
    events, bad = traces.Trace(path).read_events()
    assert bad == 0 and sum(e["event"] == "termination" for e in events) == 6
    for key in {e["episode"] for e in events}:                         # one clean history per episode
        kinds = [e["event"] for e in events if e["episode"] == key]
        assert kinds[0] == "start" and kinds[-1] == "termination" and kinds.count("termination") == 1
        assert all(len({e["attempt"] for e in events if e["episode"] == key}) == 1 for _ in [0])
    req = next(e for e in events if e["event"] == "request")
    assert len(req["messages_sha256"]) == 64 and len(req["tools_sha256"]) == 64
    again = run_episodes(Scripted(lambda r, t: pytest.fail("nothing left to run")), specs, traces.Trace(path))
    assert again["ran"] == 0 and [r["agreement"] for r in again["records"]] == [True] * 6


def test_constrained_grammar_is_strict_validation_is_not():
    s = runtime.strict_schema(TYPED["parameters"])
    assert s["additionalProperties"] is False and "additionalProperties" not in TYPED["parameters"]
    nested = runtime.strict_schema({"type": "object", "properties": {"o": {"type": "object", "properties": {}},
                                                                     "k": {"type": "object", "additionalProperties": True}}})
    assert nested["properties"]["o"]["additionalProperties"] is False
    assert nested["properties"]["k"]["additionalProperties"] is True
    assert tools.validate_call("find_person", {"query": "x", "extra": 1}, SCHEMA).ok    # the schema as given


def test_memory_right_questions_come_from_02s_answers(tmp_path):
    from memtoc.data.benchmark import load_benchmark, select_questions
    from memtoc.stages.elicitation import COLUMNS
    bench = load_benchmark()
    P = dict(load_params(None, overrides={"n_questions": 30, "agent": {"n_questions": 0, "memory_right_questions": 2}}),
             run_dir=tmp_path)
    pool = select_questions(bench.analysis, 30, P["seed"])
    right = {pool[3].qkey, pool[7].qkey, pool[20].qkey}
    rows = [dict({c: None for c in COLUMNS}, model="m", formulation=f, variant="forced", qkey=q.qkey,
                 memory_correct=(q.qkey in right and f == "reference"), mem_absent=False)
            for q in pool for f in ("reference", "paraphrase_a")]
    out = tmp_path / "scored" / "m" / "closed_book_forced.jsonl"
    out.parent.mkdir(parents=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig.of(P)
    got = core.questions_for(cfg, "m", bench, ["reference"])
    assert [q.qkey for q in got] == [pool[3].qkey, pool[7].qkey]              # the first 2, in selection order
    cfg5 = cfg.replace(agent={"n_questions": 5, "memory_right_questions": 2})
    assert [q.qkey for q in core.questions_for(cfg5, "m", bench, ["reference"])] == \
        [q.qkey for q in pool[:5]] + [pool[7].qkey, pool[20].qkey]            # pool[3] is already among the 5
    assert core.questions_for(RunConfig.of(dict(cfg5, run_dir=tmp_path / "none")), "m", bench, ["reference"]) == pool[:5]
    with pytest.raises(ConfigError, match="both 0"):
        RunConfig.of(dict(P, agent={"n_questions": 0})).agent


# ================================================================================================
# the paper's intervals and contrasts (App. G: percentile bootstrap, B = 2,000; guided -> auto)

def _units(values, form="reference"):
    import pandas as pd
    return pd.DataFrame({"formulation": form, "qkey": [f"q{i:02d}" for i in range(len(values))],
                         "value": [float(v) for v in values]})


def test_percentile_bootstrap_is_numpys_percentile_of_resampled_means():
    import numpy as np

    from memtoc.stages.agent.contrasts import percentile_bootstrap
    v = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], float)
    rng = np.random.default_rng(7)
    means = np.array([v[rng.integers(0, v.size, size=v.size)].mean() for _ in range(2000)])
    assert percentile_bootstrap(v, 2000, seed=7) == pytest.approx(list(np.percentile(means, [2.5, 97.5])))
    assert percentile_bootstrap([], 2000) == [None, None]


def test_percentile_rates_pool_per_question_means():
    import numpy as np
    import pandas as pd

    from memtoc.stages.agent.contrasts import percentile_bootstrap, percentile_rates
    u = pd.concat([_units([1, 1, 0, 1]), _units([1, 0, 0, 1], "paraphrase_a")])
    r = percentile_rates(u, ["reference", "paraphrase_a"], n_boot=500, seed=3)
    assert r["reference"]["value"] == 0.75 and r["paraphrase_a"]["value"] == 0.5 and r["reference"]["n"] == 4
    per_q = np.array([1.0, 0.5, 0.0, 1.0])                                       # q00..q03, mean over forms
    assert r["pooled"]["value"] == 0.625 and r["pooled"]["n"] == 8 and r["pooled"]["n_questions"] == 4
    assert r["pooled"]["ci95"] == pytest.approx(percentile_bootstrap(per_q, 500, 3))


def test_guided_to_auto_contrast_and_interval_by_hand(tmp_path):
    import numpy as np

    from memtoc.stages.agent.contrasts import percentile_bootstrap
    recs = []
    auto_agrees = [True, False, True, False, False]
    for i, ok in enumerate(auto_agrees):
        q = f"Who is {i}?"
        recs.append(run_one(spec("guided", question=q), lambda r, t: CALL if t == 1 else "FINAL: Jane Doe", tmp_path)[0])
        recs.append(run_one(spec("auto", question=q),
                            lambda r, t, ok=ok: "FINAL: Jane Doe" if ok else CALL.replace("find_person", "x"),
                            tmp_path)[0])
    df = metrics.episodes_frame(recs)
    s = metrics.summarize_model(df, ["reference"], protocols=["guided", "auto"], n_boot=2000, n_perm=500)
    c = s["all"]["release"]["contrasts"]["guided_to_auto"]["answer_agreement"]
    d = np.array([0.0 if ok else -1.0 for ok in auto_agrees])                   # qkeys sort as the questions
    assert c["delta"] == pytest.approx(d.mean()) == pytest.approx(-0.6)
    assert c["ci95"] == pytest.approx(percentile_bootstrap(d, 2000, 0)) and c["n_units"] == 5
    assert c["treatment"] == "auto" and c["baseline"] == "guided" and c["bootstrap"] == "percentile"
    assert 0 < c["p"] <= 1
    ex = s["all"]["release"]["contrasts"]["guided_to_auto"]["tool_execution_rate"]
    assert ex["delta"] == pytest.approx(-1.0)                                   # auto never executed
    assert set(s["all"]["release"]["contrasts"]) == {"guided_to_auto"}           # only protocols that ran
    cl = metrics.summarize_model(df, ["reference"], protocols=["guided", "auto"], n_boot=200, n_perm=100,
                                 bootstrap="cluster")["all"]["release"]["contrasts"]["guided_to_auto"]
    assert cl["answer_agreement"]["delta"] == pytest.approx(-0.6) and cl["answer_agreement"]["bootstrap"] == "cluster"
    tab = metrics.contrast_table({"models": {"m": {"slices": s}}}, "all")
    assert set(tab["contrast"]) == {"guided_to_auto"} and len(tab) == 2


# ================================================================================================
# the return per params file, the extra arms' parameters

def test_default_return_per_params_file():
    from memtoc.core.project import REPO_ROOT
    got = {f: RunConfig.of(load_params(REPO_ROOT / "params" / f), f).agent
           for f in ("default.yaml", "full.yaml", "paper.yaml", "smoke.yaml", "agent.yaml", "table7.yaml")}
    assert all(a.conditions[0] == "tool_right" for a in got.values())           # the paper's return is reported
    assert got["agent.yaml"].conditions == ("tool_right", "tool_wrong")          # the distractor as an extra arm
    for f in ("paper.yaml", "agent.yaml", "full.yaml", "table7.yaml"):
        assert got[f].bootstrap == "percentile" and got[f].n_boot == 2000, f
    assert got["paper.yaml"].adapters == ({"objective": "dpo", "fold": 0}, {"objective": "dpo", "fold": 1})
    assert all(a.sampling is None for a in got.values())
    q = type("Q", (), {"gold": "G", "near": "N"})()
    assert core.observation(q, "tool_right")[0] == "G" and core.observation(q, "tool_wrong")[0] == "N"


def test_table7_params_run_the_papers_seven_models_on_their_memory_right_slice():
    """params/table7.yaml: exactly the models of Table 7's rows (by the paper's printed names), the
    memory-right slice only, Table 7's three protocols (plus the repair arm), the paper's return."""
    from memtoc.core.project import REPO_ROOT
    from memtoc.stages.report import replication
    cfg = RunConfig.of(load_params(REPO_ROOT / "params" / "table7.yaml"), "table7.yaml")
    rows = {r["model"] for r in replication.printed("probes_agent_transfer")["agent_table7"]["rows"]}
    assert {replication.paper_model(m) for m in cfg.models} == rows and len(cfg.models) == len(rows)
    a = cfg.agent
    assert a.n_questions == 0 and a.memory_right_questions >= cfg.n_questions and a.slices == ("memory_right",)
    assert {"guided", "auto", "two_stage"} <= set(a.protocols) and a.conditions == ("tool_right",)
    assert not (cfg.finetune.enabled or cfg.transfer.enabled or cfg.probes.enabled)


def test_agent_arm_parameters_are_checked():
    ok = RunConfig.of(load_params(None, overrides={"agent": {
        "conditions": ["tool_wrong", "tool_right"], "bootstrap": "cluster", "runtime": "openai",
        "sampling": {"temperature": 0.7, "seeds": [0, 1, 2]}}})).agent
    assert ok.conditions == ("tool_wrong", "tool_right") and ok.sampling == {"temperature": 0.7, "seeds": [0, 1, 2]}
    for bad, field in (({"conditions": []}, "agent.conditions"), ({"conditions": ["tool_far"]}, "agent.conditions"),
                       ({"conditions": ["tool_right", "tool_right"]}, "agent.conditions"),
                       ({"bootstrap": "bca"}, "agent.bootstrap"),
                       ({"adapters": [{"objective": "ppo", "fold": 0}]}, "agent.adapters"),
                       ({"adapters": [{"objective": "dpo"}]}, "agent.adapters"),
                       ({"adapters": [{"objective": "dpo", "fold": 0}], "runtime": "openai"}, "agent.adapters"),
                       ({"sampling": {"temperature": 0.7, "seeds": [0]}}, "agent.sampling"),      # in-process
                       ({"sampling": {"temperature": 0, "seeds": [0]}, "runtime": "openai"}, "agent.sampling"),
                       ({"condition": "tool_wrong"}, "condition")):
        with pytest.raises(ConfigError, match=field):
            RunConfig.of(load_params(None, overrides={"agent": bad})).agent


def test_adapter_arm_runs_held_out_questions_and_skips_absent_adapters(tmp_path, monkeypatch):
    from memtoc.core.records import Question
    from memtoc.generation import models
    from memtoc.stages.agent import stage
    P = dict(load_params(None, overrides={"agent": {"n_questions": 4, "protocols": ["guided", "auto"],
                                                    "adapters": [{"objective": "dpo", "fold": 0},
                                                                 {"objective": "dpo", "fold": 1},
                                                                 {"objective": "sft", "fold": 0}]}}),
             run_dir=tmp_path)
    cfg = RunConfig.of(P)
    model = cfg.agent.models[0]
    label = models.get_model(model).label
    for fold in (0, 1):                                   # 04's dpo adapters; sft was never trained
        d = cfg.paths.adapter(label, "dpo", fold)
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(b"x")
    qs = [Question(f"{i}.0", i, 0, f"k{i}", f"Who is {i}?", "John Roe", "person", "r", "Jane Doe", "Jane Doe", None,
                   fold=i % 2) for i in range(4)]
    seen = []

    def fake_runtime(cfg_, model_, adapter=None, seed=None):
        seen.append(adapter)
        rt = Scripted(lambda r, t: CALL if t == 1 and r.tool_choice != "none" else "FINAL: John Roe")   # the gold
        rt.identity = {"adapter": str(adapter)}
        return rt
    monkeypatch.setattr(stage, "runtime_for", fake_runtime)
    memory = __import__("pandas").DataFrame([{"formulation": f, "qkey": q.qkey, "span": "John Roe",
                                              "memory_correct": True, "mem_absent": False}
                                             for q in qs for f in cfg.agent.formulations])
    arm = {"cfg": cfg, "model": model, "questions": qs, "memory": memory, "forms": list(cfg.agent.formulations),
           "show_progress": False}
    base = core.build_specs(model, qs, memory, cfg.agent, arm["forms"], "base")
    base_recs = run_episodes(Scripted(lambda r, t: "FINAL: x"), base, traces.Trace(tmp_path / "b.jsonl"))["records"]
    notices, logged = [], []
    out = stage.adapter_arms(arm, base_recs, notices, logged.append)
    assert seen == [cfg.paths.adapter(label, "dpo", 0), cfg.paths.adapter(label, "dpo", 1)]
    assert len(notices) == 1 and "sft fold 0 skipped" in notices[0] and logged
    folds = out["dpo"]["folds"]
    assert [(f["fold"], f["questions"]) for f in folds] == [(0, 2), (1, 2)]    # the other fold's questions
    assert cfg.paths.agent_arm_traces(model, "dpo-fold0").is_file()
    auto = out["dpo"]["slices"]["all"]["release"]["protocols"]["auto"]
    assert auto["n_questions"] == 4 and auto["answer_agreement"]["pooled"]["value"] == 1.0
    vb = out["dpo"]["versus_base"]["all"]["release"]["auto"]["answer_agreement"]
    assert vb["delta"] == 1.0 and vb["treatment"] == "adapter" and vb["n_units"] == 4 * len(arm["forms"])


# ================================================================================================
# the runtime's caches: one look-up path, files written before still read

def test_server_cache_written_before_is_read_and_sampling_changes_the_body(tmp_path):
    from memtoc.generation import cache as _cache
    rt = OpenAIRuntime("qwen2.5-7b-instruct", base_url="http://127.0.0.1:9/v1", server="vllm", cache_dir=tmp_path)
    req = ChatRequest([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], None, "auto", 16)
    _, body = rt.request_body(req)
    assert body["temperature"] == 0 and isinstance(body["temperature"], int)
    old_key = _cache.request_key(rt.identity, _cache.canonical_json(body))        # the formula files were keyed by
    data = {"choices": [{"message": {"content": "FINAL: Paris"}, "finish_reason": "stop"}], "usage": {}}
    _cache.append_records(tmp_path / "generations_openai.jsonl", [{"key": old_key, "text": "FINAL: Paris",
                                                                    "response": data, "seconds": 0.5}])
    got = rt.chat_many([req])[0]                                                   # port 9: a request would fail
    assert got.cached and got.content == "FINAL: Paris" and got.seconds == 0.5
    t = OpenAIRuntime("qwen2.5-7b-instruct", base_url="http://127.0.0.1:9/v1", server="vllm", seed=1, temperature=0.7)
    assert t.request_body(req)[1]["temperature"] == 0.7 and t.request_body(req)[1]["seed"] == 1
    assert t.identity["temperature"] == 0.7 and "temperature" not in rt.identity


def test_constrained_cache_key_is_the_one_written_before(tmp_path):
    from memtoc.generation import cache as _cache
    ident, lib, schema = {"model": "m"}, {"library": "llguidance", "version": "1"}, {"type": "object"}
    old = _cache.request_key({"generator": ident, "constrained": lib, "json_options": runtime.JSON_OPTIONS,
                              "schema": schema, "max_tokens": 64, "tie_margin": runtime.TIE_MARGIN}, "prompt<call>")
    assert runtime.constrained_key(ident, lib, runtime.JSON_OPTIONS, schema, 64, runtime.TIE_MARGIN,
                                   "prompt<call>") == old
    path = tmp_path / "constrained.jsonl"
    _cache.append_records(path, [{"key": old, "text": "x", "n_prompt_tokens": 1, "n_new_tokens": 1, "finish": "complete"}])
    cache = runtime.ReplyCache(path)
    assert cache.get(old)["text"] == "x" and cache.get_many([old, "other"]).keys() == {old}
    assert runtime.ReplyCache(None).get(old) is None


@pytest.mark.parametrize("paths, kind", [
    # vLLM 0.32's server also serves /v1/systemone: its own paths decide first
    ({"/tokenize", "/version", "/v1/systemone", "/v1/chat/completions"}, "vllm"),
    ({"/v1/tokenize", "/v1/chat/completions"}, "vllm"),
    ({"/load_model", "/v1/systemone", "/v1/chat/completions"}, "transformers"),
    ({"/v1/chat/completions"}, "other"),
])
def test_the_server_kind_comes_from_its_openapi_paths(paths, kind):
    from memtoc.stages.agent.runtime.server import detect_server

    class _Session:
        def get(self, url, timeout):
            assert url == "http://127.0.0.1:9/openapi.json"
            return types.SimpleNamespace(status_code=200, json=lambda: {"paths": {p: {} for p in paths}})
    assert detect_server("http://127.0.0.1:9/v1", session=_Session()) == kind
