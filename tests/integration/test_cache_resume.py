"""Kill a real generation run part-way (SIGKILL after its first batch is on disk), rerun it, and
check that finished replies were not regenerated and the result equals an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from memtoc.generation import cache, models

pytestmark = pytest.mark.integration

N = 8
SCRIPT = textwrap.dedent("""
    import json, sys
    from memtoc.generation import models
    cache_path = sys.argv[1]
    prompts = [f"Answer from memory. End your reply with one line that starts with 'FINAL: ' followed "
               f"by your answer.\\nQuestion: In which year was person number {i} born?\\n" for i in range(%d)]
    g = models.load_generator("smollm2-135m-instruct", batch_size=2, max_new_tokens=24, show_progress=False)
    print("LOADED", flush=True)
    out = g.generate(prompts, cache_path=cache_path)
    print(json.dumps([{"key": r.key, "text": r.text, "cached": r.cached} for r in out]), flush=True)
""" % N)


def _run(script, cache_path):
    p = subprocess.run([sys.executable, str(script), str(cache_path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _lines(path):
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_kill_and_resume(tmp_path):
    models.prepare_model("smollm2-135m-instruct")
    script = tmp_path / "gen.py"
    script.write_text(SCRIPT)
    killed_cache = tmp_path / "a" / "gen" / "m" / "arm.jsonl"
    proc = subprocess.Popen([sys.executable, str(script), str(killed_cache)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while _lines(killed_cache) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    at_kill = cache.read_cache(killed_cache)
    assert 2 <= len(at_kill) < N, f"the run was not killed part-way ({len(at_kill)} of {N} on disk)"

    resumed = _run(script, killed_cache)
    assert len(resumed) == N
    for r in resumed:  # finished work reused, the rest generated now
        assert r["cached"] == (r["key"] in at_kill)
        if r["cached"]:
            assert r["text"] == at_kill[r["key"]]["text"]
    assert sum(not r["cached"] for r in resumed) == N - len(at_kill)
    assert len(cache.read_cache(killed_cache)) == N

    fresh = _run(script, tmp_path / "b" / "gen" / "m" / "arm.jsonl")
    assert not any(r["cached"] for r in fresh)
    assert [(r["key"], r["text"]) for r in resumed] == [(r["key"], r["text"]) for r in fresh]
