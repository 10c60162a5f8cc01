"""The Inspect task (memtoc.run.inspect_task) and its import into a run directory (memtoc.run.inspect_import).

With Inspect's mock model answering by a rule whose metrics are known in advance, and with a real
OpenAI-compatible server (`transformers serve` on the embedded SmolLM2): the episodes' chats, one
closed-book call per question and formulation, memtoc's scoring, the headline metrics in the log, and
an imported run that `memtoc verify` passes.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

inspect_ai = pytest.importorskip("inspect_ai", reason="the optional extra memtoc[inspect] (in requirements/cpu.lock)")

from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.model import ModelOutput, ModelUsage, get_model  # noqa: E402

from memtoc.core import prompts  # noqa: E402
from memtoc.core.errors import ConfigError, DataError  # noqa: E402
from memtoc.run import export, inspect_import, inspect_task  # noqa: E402
from memtoc.stages.report import claims  # noqa: E402

N_Q = 6


def _reply(text):
    out = ModelOutput.from_content(model="mockllm/model", content=f"Let me answer.\nFINAL: {text}")
    out.usage = ModelUsage(input_tokens=1, output_tokens=3, total_tokens=4)   # no token counting (offline)
    return out


class Rule:
    """A mock model that knows the gold of the questions in ``known``: closed-book it answers those
    correctly and the others wrongly; with a tool it keeps a known answer (``follow=False``) and otherwise
    follows the returned value, or abstains on an error. Records every call."""

    def __init__(self, gold_by_question, known, follow=False):
        self.gold, self.known, self.follow, self.calls = gold_by_question, known, follow, []

    def __call__(self, messages, tools, tool_choice, config):
        self.calls.append((messages, tools, tool_choice, config))
        question = messages[0].text.rstrip("\n").split("\n")[-1].split(": ", 1)[1]
        gold = self.gold[question]
        tool = [m for m in messages if m.role == "tool"]
        if not tool:
            return _reply(gold if question in self.known else "Nobody Whatsoever")
        if question in self.known and not self.follow:
            return _reply(gold)
        value = json.loads(tool[0].text).get("result")
        return _reply(value if value else "UNKNOWN")


@pytest.fixture(scope="module")
def episodes():
    return inspect_task.task_episodes(n_questions=N_Q)


def _run(rule, tmp_path, **task_args):
    log = inspect_eval(inspect_task.memtoc(n_questions=N_Q, **task_args), model=get_model("mockllm/model",
                       custom_outputs=rule), log_dir=str(tmp_path / "logs"), display="none")[0]
    assert log.status == "success", log.error
    return log


def _metrics(log):
    return {k: v.value for k, v in log.results.scores[0].metrics.items()}


@pytest.fixture(scope="module")
def keeper(episodes, tmp_path_factory):
    """The rule that keeps what it knows: retention, tool following and wrong following are all 1."""
    gold = {e.question: e.gold for e in episodes}
    known = {e.question for e in episodes if e.instance_id % 2 == 0} or {episodes[0].question}
    rule = Rule(gold, known)
    tmp = tmp_path_factory.mktemp("keeper")
    return rule, _run(rule, tmp), tmp


def test_one_sample_per_episode_and_one_closed_book_call_per_question(episodes, keeper):
    rule, log, _ = keeper
    assert sorted(s.id for s in log.samples) == sorted(e.episode_id for e in episodes)
    n_closed = len({(e.qkey, e.formulation) for e in episodes})
    n_tool = sum(e.condition != "no_tool" for e in episodes)
    assert len(rule.calls) == n_closed + n_tool          # the no_tool episode reuses the closed-book reply
    assert len(episodes) == N_Q * 3 * 4


def test_the_tool_return_is_a_tool_call_and_a_tool_message(episodes, keeper):
    rule, log, _ = keeper
    by_id = {e.episode_id: e for e in episodes}
    sample = next(s for s in log.samples if by_id[s.id].condition == "tool_wrong")
    ep = by_id[sample.id]
    user, call, tool, instruction, reply = sample.messages
    assert user.role == "user" and user.text == prompts.QUESTION_LABEL[ep.formulation] + ep.question
    assert call.tool_calls[0].function == ep.schema["name"] and tool.role == "tool"
    assert tool.tool_call_id == call.tool_calls[0].id and tool.text == prompts.to_json({"result": ep.tool_value})
    assert instruction.text.endswith(prompts.FINAL_LINE[ep.formulation]) and reply.role == "assistant"
    # calling a tool is not allowed (Inspect sends the definitions only to providers that need them)
    msgs, tools, choice, config = next(c for c in rule.calls if len(c[0]) == 4 and c[0][2].text == tool.text)
    assert choice == "none" and [t.name for t in tools] in ([], [ep.schema["name"]]) and config.temperature == 0
    closed = next(s for s in log.samples if by_id[s.id].condition == "no_tool")
    assert closed.messages[0].text == prompts.closed_book_prompt(by_id[closed.id].question,
                                                                  by_id[closed.id].formulation, "forced")


def test_the_headline_metrics_follow_the_rule(tmp_path, episodes, keeper):
    _, log, _ = keeper
    m = _metrics(log)
    assert m["retention"] == 1.0 and m["tool_follow"] == 1.0 and m["wrong_follow"] == 1.0
    assert m["retention_lo"] <= m["retention"] <= m["retention_hi"]
    gold = {e.question: e.gold for e in episodes}
    follower = _run(Rule(gold, set(gold), follow=True), tmp_path)     # knows everything, follows every tool
    f = _metrics(follower)
    assert f["retention"] == 0.0 and math.isnan(f["tool_follow"])     # no question with a wrong memory
    assert f["err_abstain"] == 1.0                                   # an error return: UNKNOWN


def test_an_imported_log_is_a_run_that_verifies(keeper, tmp_path):
    _, log, tmp = keeper
    run = tmp_path / "run"
    out = inspect_import.import_log(log.location, run)
    assert out.model == "inspect-model" and out.episodes == len(log.samples) and out.questions == N_Q
    ev = json.loads((run / "summaries" / "evaluation.json").read_text())
    pooled = ev["models"]["inspect-model"]["headline"]["pooled"]
    for name in ("retention", "tool_follow", "wrong_follow", "err_abstain"):
        assert pooled[name]["value"] == pytest.approx(_metrics(log)[name], nan_ok=True)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["source"]["model"] == "mockllm/model" and cfg["params"]["n_questions"] == N_Q
    result = claims.verify(run)
    assert result.ok, result.table()
    export.export_run(run, tmp_path / "dataset")                        # and it publishes as a dataset
    assert len(pd.read_parquet(tmp_path / "dataset" / "episodes.parquet")) == len(log.samples)
    with pytest.raises(ConfigError, match="not empty"):
        inspect_import.import_log(log.location, run)
    (run / "left-over.txt").write_text("from an earlier import")
    inspect_import.import_log(log.location, run, force=True)              # --force replaces, never mixes
    assert not (run / "left-over.txt").exists() and claims.verify(run).ok
    assert not list(tmp_path.glob(".run.importing-*"))                   # the staging folder is gone
    with pytest.raises(DataError, match="no such Inspect log"):
        inspect_import.import_log(tmp_path / "missing.eval", tmp_path / "x")


def test_a_partial_or_repeated_log_is_refused_and_nothing_is_written(episodes, tmp_path):
    gold = {e.question: e.gold for e in episodes}
    rule = Rule(gold, set())
    part = inspect_eval(inspect_task.memtoc(n_questions=N_Q), model=get_model("mockllm/model", custom_outputs=rule),
                        log_dir=str(tmp_path / "logs"), display="none", limit=5)[0]
    with pytest.raises(DataError, match="5 of the 72 episodes"):
        inspect_import.import_log(part.location, tmp_path / "part")
    twice = inspect_eval(inspect_task.memtoc(n_questions=1, formulations="reference"), epochs=2,
                         model=get_model("mockllm/model", custom_outputs=rule), log_dir=str(tmp_path / "logs"),
                         display="none")[0]
    with pytest.raises(DataError, match="epochs is 2"):
        inspect_import.import_log(twice.location, tmp_path / "twice")
    assert not (tmp_path / "part").exists() and not (tmp_path / "twice").exists()


def test_a_metric_defined_on_one_side_only_is_a_difference():
    import pandas as pd
    from types import SimpleNamespace as NS
    rows = pd.DataFrame([{"qkey": "q", "condition": "tool_error", "cell": None, "followed_tool": False,
                          "kept_memory": False, "outcome": "neither", "abstain": True, "final_correct": False,
                          "formulation": "reference", "arm": "untreated", "frame": "schema",
                          "payload_kind": "service_unavailable", "tool_correct": False, "mem_absent": False,
                          "memory_correct": False}])
    log = NS(results=NS(scores=[NS(metrics={"retention": NS(value=0.5)})]))
    with pytest.raises(DataError, match="retention is 0.5 in the log but nan"):
        inspect_import._compare_headline(log, rows, 10, "x.eval")


def test_bad_task_options_name_the_option():
    with pytest.raises(ConfigError, match="formulation"):
        inspect_task.task_episodes(n_questions=2, formulations="reference,paraphrase_c")
    with pytest.raises(ConfigError, match="no episode"):
        inspect_task.task_episodes(n_questions=2, conditions="no_tool", arms="warn")
    warned = inspect_task.task_episodes(n_questions=2, formulations="reference", arms="untreated,warn")
    assert {e.condition for e in warned if e.arm == "warn"} == {"tool_right", "tool_wrong", "tool_error"}


@pytest.mark.integration
def test_inspect_eval_on_a_local_openai_server(tmp_path):
    """`inspect eval` of the task against `transformers serve` (the embedded SmolLM2), through Inspect's
    OpenAI-compatible provider, then the import and `memtoc verify`. SmolLM2-135M is a plumbing check."""
    from test_backends_openai import _free_port, _wait_for
    from transformers.utils.import_utils import is_serve_available

    from memtoc.generation import models
    if not is_serve_available():
        pytest.skip("transformers[serving] is not installed (requirements/cpu.lock installs it)")
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
    path = str(models.prepare_model("smollm2-135m-instruct"))
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([exe, "serve", path, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_for(proc, base, "transformers serve")
        model = get_model("openai-api/memtoc_test/" + path, base_url=base, api_key="none")
        log = inspect_eval(inspect_task.memtoc(n_questions=2, formulations="reference", max_tokens=24), model=model,
                           log_dir=str(tmp_path / "logs"), display="none", max_connections=2)[0]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert log.status == "success", log.error
    assert len(log.samples) == 8 and all(s.output.completion for s in log.samples)
    tool_sample = next(s for s in log.samples if "tool_right" in str(s.id))
    assert [m.role for m in tool_sample.messages] == ["user", "assistant", "tool", "user", "assistant"]
    run = tmp_path / "run"
    inspect_import.import_log(log.location, run, label="smollm2-served")
    assert claims.verify(run).ok
