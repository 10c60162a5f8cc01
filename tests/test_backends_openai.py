"""The openai backend against a REAL local OpenAI-compatible server (memtoc.backends.serve on
127.0.0.1, serving the embedded model): same replies as the transformers backend, cache works."""
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from memtoc import models

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
    proc = subprocess.Popen([sys.executable, "-m", "memtoc.backends.serve", "smollm2-135m-instruct",
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
