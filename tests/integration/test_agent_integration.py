"""The agent loop on the real embedded model: the guided protocol yields a schema-valid call in every
episode (in-process, llguidance-constrained arguments); batched constrained decoding equals one by
one; notebook 07's stage writes summaries/agent.json; and a real third-party OpenAI-compatible server
(`transformers serve`) runs the auto protocol while memtoc refuses the protocols it would silently
degrade (it ignores tool_choice)."""
from __future__ import annotations

import json

import pytest
from test_backends_openai import transformers_server  # noqa: F401  (the `transformers serve` fixture)

from memtoc.config.runconfig import RunConfig
from memtoc.core.prompts import value_output
from memtoc.data.benchmark import load_benchmark, select_questions
from memtoc.generation import models
from memtoc.stages.agent import core, protocols, runtime, stage, tools, traces
from memtoc.stages.agent.protocols import TERMINATIONS, EpisodeSpec, run_episodes

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def questions():
    return select_questions(load_benchmark().analysis, 4)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    rt = runtime.TransformersRuntime(MODEL, max_tokens_per_call=48, cache_dir=tmp_path_factory.mktemp("agentcache"))
    yield rt
    rt.close()


def specs_for(qs, protocol, variant="release", model=MODEL):
    out = []
    for q in qs:
        schema, kind = tools.episode_schema(q, variant)
        out.append(EpisodeSpec(model=model, protocol=protocol, formulation="reference", schema_variant=variant,
                               schema_kind=kind, question_id=q.id, qkey=q.qkey, instance_id=q.instance_id,
                               question=q.question, gold=q.gold, gold_kind=q.gold_kind, condition="tool_wrong",
                               tool_value=q.near, observation=value_output(q.near), schema=schema,
                               max_tokens_per_call=48, max_tokens_per_episode=144))
    return out


def test_guided_yields_a_schema_valid_call_in_every_episode(smol, questions, tmp_path):
    specs = specs_for(questions, "guided") + specs_for(questions, "guided", "typed") + specs_for(questions, "auto")
    tr = traces.Trace(tmp_path / "traces.jsonl")
    res = run_episodes(smol, specs, tr)
    guided = [r for r in res["records"] if r["protocol"] == "guided"]
    assert len(guided) == 8 and all(r["executed"] and r["n_calls_executed"] == 1 for r in guided)
    events, _ = tr.read_events()
    checks = [e for e in events if e["event"] == "validation" and "|guided|" in e["episode_id"]]
    assert len(checks) == 8 and all(e["ok"] and e["type_errors"] == 0 for e in checks)
    for s in specs[:8]:                                    # the arguments really are valid under the schema
        call = next(e for e in events if e["event"] == "validation" and e["episode"] == s.key)
        assert tools.validate_call(call["name"], call["arguments"], s.schema).ok
    auto = [r for r in res["records"] if r["protocol"] == "auto"]
    assert all(r["termination"] in TERMINATIONS for r in auto)              # recorded, whatever it is
    assert smol.constrained_stats["tokens"] > 0 and smol.constrained_stats["mask_ms_per_token"] > 0
    again = run_episodes(smol, specs, traces.Trace(tmp_path / "traces.jsonl"))
    assert again["ran"] == 0 and [r["executed"] for r in again["records"]] == [r["executed"] for r in res["records"]]


def test_batched_constrained_decoding_equals_one_by_one(smol, questions):
    dec = smol.decoder()
    jobs = []
    for q in questions[:3]:
        schema, _ = tools.episode_schema(q, "typed")
        text = smol.render([{"role": "system", "content": protocols.AGENT_SYSTEM},
                            {"role": "user", "content": q.question}], [tools.function_tool(schema)])
        ids = dec.tokenizer(text + smol.format.begin(schema["name"]), add_special_tokens=True)["input_ids"]
        jobs.append(runtime.ConstrainedJob(ids, schema["parameters"], 24))
    batched = dec.decode_many(jobs)
    alone = [dec.decode_many([j])[0] for j in jobs]
    assert batched == alone
    assert all(how in ("complete", "length") for _, how in batched)


def test_stage_writes_the_agent_summary(tmp_path):
    P = RunConfig.load(None, overrides={
        "output_root": str(tmp_path), "run_name": "ag", "n_questions": 2, "formulations": ["reference"], "n_boot": 100,
        "n_perm": 100, "agent": {"n_questions": 2, "protocols": ["guided", "auto", "auto_constrained"],
                                 "schema_variants": ["release"], "max_tokens_per_call": 40,
                                 "max_tokens_per_episode": 120}})
    s = stage.run(P, show_progress=False, log=lambda *a: None)
    on_disk = json.loads((tmp_path / "ag" / "summaries" / "agent.json").read_text())
    assert on_disk["models"][MODEL]["support"]["episodes"] == 6 and "EMBEDDED-MODEL" in on_disk["caveat"]
    node = on_disk["models"][MODEL]["slices"]["all"]["release"]
    for p in ("guided", "auto", "auto_constrained"):
        for metric in ("answer_agreement", "tool_execution_rate"):
            assert set(node["protocols"][p][metric]["pooled"]) >= {"value", "ci95", "n"}
        assert sum(t["count"] for t in node["protocols"][p]["terminations"].values()) == 2
        assert set(node["protocols"][p]["mechanisms"]) == set(protocols.MECHANISMS)
    assert node["protocols"]["guided"]["tool_execution_rate"]["pooled"]["value"] == 1.0
    assert set(node["repair"]) == {"answer_agreement", "tool_execution_rate"}
    assert set(node["contrasts"]) == {"guided_to_auto"} and node["contrasts"]["guided_to_auto"]["answer_agreement"]["ci95"]
    assert on_disk["config"]["conditions"] == ["tool_right"] and on_disk["config"]["bootstrap"] == "percentile"
    assert on_disk["models"][MODEL]["adapters"] == {} and on_disk["models"][MODEL]["sampling"] is None
    assert (tmp_path / "ag" / "agent" / MODEL / "cache" / "constrained.jsonl").is_file()
    assert on_disk["constrained_decoding"]["library"] == "llguidance" and on_disk["published"]["rows"]
    assert s["models"][MODEL]["resumed"]["ran"] == 6 and s["timing"]["constrained_decoding"][MODEL]["tokens"] > 0
    assert core.plot(s, tmp_path / "f.png").stat().st_size > 5000


def test_auto_protocol_on_transformers_serve_and_refusal(transformers_server, smol, questions, tmp_path):  # noqa: F811
    """`transformers serve` (a real third-party server) ignores tool_choice: memtoc detects it, refuses
    guided / two_stage / auto_constrained there, and runs auto (memtoc renders SmolLM2's documented
    tool format into the system turn, the server applies the model's own template) with the same
    first replies as the in-process runtime."""
    base, path = transformers_server
    rt = runtime.OpenAIRuntime(path, base_url=base, served_model=path, max_tokens_per_call=48,
                               cache_dir=tmp_path / "cache", concurrency=1)
    assert rt.server == "transformers" and rt.format.name == "smollm2"
    for p in ("guided", "two_stage", "auto_constrained"):
        with pytest.raises(runtime.ProtocolUnsupported, match=p):
            rt.check_protocols(["auto", p])
    rt.check_protocols(["auto", "oracle"])
    specs = specs_for(questions[:2], "auto", model=path)
    tr = traces.Trace(tmp_path / "traces.jsonl")
    res = run_episodes(rt, specs, tr)
    assert [r["termination"] in TERMINATIONS for r in res["records"]] == [True, True]
    events, _ = tr.read_events()
    reqs = [e for e in events if e["event"] == "request"]
    resp = [e for e in events if e["event"] == "response"]
    assert len(reqs) >= 2 and all(len(e["messages_sha256"]) == 64 for e in reqs)
    assert all(e["n_prompt_tokens"] > 0 for e in resp)
    first = [smol.chat(s.messages(), s.tools, "auto", 48) for s in specs]
    served = [next(e for e in resp if e["episode"] == s.key) for s in specs]
    for local, remote in zip(first, served):    # same rendering and greedy decoding (in-process may stop at FINAL)
        assert remote["text"].startswith(local.text.rstrip()) or local.text.startswith(remote["text"].rstrip())
    assert models.get_model(path).chat


def test_auto_constrained_repairs_a_free_call_from_its_opening(smol, questions, monkeypatch):
    """The lazy grammar: where the free reply opens a call (the format's trigger), the text before it
    is kept and the call is decoded again under the schema (same weights, same prompt)."""
    from memtoc.generation.backends.base import Reply
    q = questions[0]
    schema, _ = tools.episode_schema(q, "typed")
    call = '<tool_call>[{"name": "' + schema["name"] + '", "arguments": {"exact_match": "true"'
    free = {"text": call}

    class Free:                                     # the free generation returns a broken call; the rest is real
        def __init__(self, real):
            self.real, self.identity = real, real.identity

        def load(self):
            return self.real.load()

        def generate(self, prompts, **kw):
            return [Reply(free["text"], 10, 30, 0.0, "k", False, "length") for _ in prompts]
    monkeypatch.setattr(smol, "gen", Free(smol.gen))
    msgs = [{"role": "system", "content": protocols.AGENT_SYSTEM}, {"role": "user", "content": q.question}]
    plain = smol.chat(msgs, [tools.function_tool(schema)], "auto", 48)
    assert plain.parse_error and not plain.calls                  # auto: the broken call stays broken (T2)
    fixed = smol.chat(msgs, [tools.function_tool(schema)], "auto", 48, constrained=True)
    assert len(fixed.calls) == 1 and fixed.constrained_tokens > 0 and fixed.parse_error is None
    assert tools.validate_call(fixed.calls[0].name, fixed.calls[0].arguments, schema).ok
    free["text"] = "Let me check. " + call                       # text before the opening is the model's own
    kept = smol.chat(msgs, [tools.function_tool(schema)], "auto", 48, constrained=True)
    assert kept.text.startswith("Let me check. <tool_call>[{") and kept.content == "Let me check."
    assert kept.constrained_tokens > 0
