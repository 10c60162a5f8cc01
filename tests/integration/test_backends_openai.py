"""The openai backend against REAL local OpenAI-compatible servers serving the embedded model on
127.0.0.1: memtoc's own stdlib server (memtoc.generation.backends.serve; same replies as the transformers
backend, cache works) and a third-party one, `transformers serve` (transformers[serving], a dev
dependency; same replies as `model.generate` on the model's own chat template)."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils.import_utils import is_serve_available

from memtoc.generation import models

pytestmark = pytest.mark.integration

PROMPTS = ["Answer from memory. End your reply with one line that starts with 'FINAL: ' followed by "
           "your answer.\nQuestion: What is the capital of France?\n",
           "Answer from memory. End your reply with one line that starts with 'FINAL: ' followed by "
           "your answer.\nQuestion: Who wrote Hamlet?\n"]


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def server():
    models.prepare_model("smollm2-135m-instruct")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "memtoc.generation.backends.serve", "smollm2-135m-instruct",
                             "--port", str(port), "--batch-size", "1", "--max-new-tokens", "24"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail("server exited: " + proc.stdout.read()[-2000:])
            try:
                if requests.get(base + "/models", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not come up within 180 s")
        yield base
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_openai_backend_matches_transformers(server, tmp_path):
    g = models.load_generator("smollm2-135m-instruct", backend="openai", base_url=server,
                              model="smollm2-135m-instruct", max_new_tokens=24, concurrency=2,
                              show_progress=False)
    cache = tmp_path / "gen" / "m" / "arm.jsonl"
    got = g.generate(PROMPTS, cache_path=cache)
    assert all(r.text and not r.cached for r in got)
    assert all(r.n_prompt_tokens > 0 and 0 < r.n_new_tokens <= 24 for r in got)
    local = models.load_generator("smollm2-135m-instruct", batch_size=1, max_new_tokens=24, show_progress=False)
    want = local.generate(PROMPTS)
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.n_prompt_tokens for r in got] == [r.n_prompt_tokens for r in want]
    again = g.generate(PROMPTS, cache_path=cache)  # served from the cache: no request made
    assert [r.cached for r in again] == [True, True] and [r.text for r in again] == [r.text for r in got]


def test_server_rejects_bad_requests(server):
    url = server + "/chat/completions"
    r = requests.post(url, json={"messages": [{"role": "system", "content": "x"},
                                              {"role": "user", "content": "y"}]}, timeout=30)
    assert r.status_code == 400 and "one user message" in r.json()["error"]["message"]
    r = requests.post(url, json={"model": "other", "messages": [{"role": "user", "content": "y"}]}, timeout=30)
    assert r.status_code == 404
    g = models.load_generator("nonexistent-model", backend="openai", base_url=server, max_retries=0,
                              show_progress=False)
    with pytest.raises(Exception, match="refused the request"):
        g.generate(["hi"])


# -- a third-party server: `transformers serve` -----------------------------------------------------
def _wait_for(proc, base, what, limit=240):
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited: " + proc.stdout.read()[-3000:])
        try:
            if requests.get(base + "/models", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"{what} did not come up within {limit} s")


@pytest.fixture(scope="module")
def transformers_server():
    """`transformers serve` pinned to the prepared embedded model (a local directory: no network)."""
    if not is_serve_available():
        pytest.skip("transformers[serving] (fastapi, uvicorn, openai) is not installed; `make install` "
                    "installs it from requirements/cpu.lock")
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
    if exe is None:
        pytest.skip("the `transformers` command is not on PATH")
    path = str(models.prepare_model("smollm2-135m-instruct"))
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([exe, "serve", path, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_for(proc, base, "transformers serve")
        yield base, path
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _reference(path, texts, n_new):
    """Greedy float32 `model.generate` on each rendered text, one at a time: [(reply, prompt tokens)]."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
        out.append((tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True), ids.shape[1]))
    return out


def test_openai_backend_against_transformers_serve(transformers_server, tmp_path):
    """The chat request memtoc sends (one user turn, no system message, temperature 0) is answered
    by transformers' own server with the reply greedy `generate` gives on the model's chat template
    (SmolLM2's template adds its default system prompt: the server's format, not memtoc's), and the
    usage counts are the template's token count."""
    base, path = transformers_server
    g = models.load_generator(path, backend="openai", base_url=base, model=path, max_new_tokens=24,
                              concurrency=2, stop_at_final=False, show_progress=False)
    got = g.generate(PROMPTS, cache_path=tmp_path / "gen" / "m" / "arm.jsonl")
    tok = AutoTokenizer.from_pretrained(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    for r, (want, n_prompt) in zip(got, _reference(path, texts, 24)):
        assert r.text and r.text == want
        assert r.n_prompt_tokens == n_prompt and 0 < r.n_new_tokens <= 24
    g.close()
