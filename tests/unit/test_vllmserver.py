"""memtoc starts vLLM's OpenAI server for the agent loop (``agent.runtime_options.launch: vllm``): the
command line, the wait for ``/v1/models``, the stop of the whole process group, the errors with the
server's log, the configuration rules, and the runtime options the stage then gets. A stand-in server
(a small Python HTTP server) plays vLLM here; tests/vllm_cpu runs the real one."""
from __future__ import annotations

import os
import sys
import time

import pytest

from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.generation import hardware
from memtoc.generation.backends import vllmserver as vs
from memtoc.generation.backends.openai import BackendError
from memtoc.run import servers
from memtoc.stages.agent import serving

STAND_IN = r'''
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
port, pidfile = int(sys.argv[1]), sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # vLLM's engine process
open(pidfile, "w").write(str(child.pid))
print("stand-in: starting", flush=True)
time.sleep(0.5)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                  # a zombie that nobody reaped yet is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_the_command_line(monkeypatch):
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "0")
    cmd = vs.server_command("/models/q", "Qwen/Qwen2.5-7B-Instruct", 8123, "auto", "hermes", cuda=False,
                            options={"max_model_len": 4096, "enforce_eager": True, "disable_log_stats": False},
                            python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    s = " ".join(cmd)
    for part in ("--model /models/q", "--served-model-name Qwen/Qwen2.5-7B-Instruct", "--host 127.0.0.1",
                 "--port 8123", "--dtype float32", "--seed 0", "--enable-auto-tool-choice --tool-call-parser hermes",
                 "--max-model-len 4096", "--enforce-eager", "--gpu-memory-utilization 0.25"):
        assert part in s, part
    assert "disable-log-stats" not in s                    # a false flag is left out
    gpu = " ".join(vs.server_command("/m", "m", 1, "bfloat16", None, cuda=True, python="py"))
    assert "--dtype bfloat16" in gpu and "tool" not in gpu and "gpu-memory-utilization" not in gpu
    with pytest.raises(BackendError, match="tool parser 'smollm2'"):
        vs.server_command("/m", "m", 1, tool_parser="smollm2")


def test_the_server_is_waited_for_and_stopped_with_its_children(tmp_path):
    port, pidfile = vs.free_port(), tmp_path / "child.pid"
    cmd = [sys.executable, "-c", STAND_IN, str(port), str(pidfile)]
    with vs.VLLMServer(cmd, port, tmp_path / "logs" / "server.log", timeout_s=60, grace_s=5) as srv:
        import requests
        assert requests.get(srv.base_url + "/models", timeout=5).status_code == 200
        proc, child = srv.proc, int(pidfile.read_text())
        assert _alive(child)
    assert srv.proc is None and proc.poll() is not None
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the server's own child process outlived it"
    assert "stand-in: starting" in (tmp_path / "logs" / "server.log").read_text()
    srv.close()                                            # twice is fine


def test_a_server_that_exits_or_never_answers_fails_with_its_log(tmp_path):
    bad = [sys.executable, "-c", "import sys; print('ValueError: no such model'); sys.exit(3)"]
    with pytest.raises(BackendError, match=r"exited \(code 3\)(.|\n)*no such model"):
        vs.VLLMServer(bad, vs.free_port(), tmp_path / "a.log", timeout_s=60)
    slow = [sys.executable, "-c", "import time; print('loading'); time.sleep(60)"]
    t0 = time.time()
    with pytest.raises(BackendError, match=r"did not answer(.|\n)*loading"):
        vs.VLLMServer(slow, vs.free_port(), tmp_path / "b.log", timeout_s=2, grace_s=2)
    assert time.time() - t0 < 30


def _agent(**agent):
    return RunConfig.load("params/smoke.yaml", overrides={"agent": agent}).agent


def test_launch_is_checked_in_the_params():
    a = _agent(runtime="openai", runtime_options={"launch": "vllm", "launch_options": {"max_model_len": 2048}})
    assert a.runtime_options["launch"] == "vllm"
    for opts, runtime, msg in [
        ({"launch": "vllm"}, "transformers", "set agent.runtime: openai"),
        ({"launch": "vllm", "base_url": "http://127.0.0.1:8000/v1"}, "openai", "base_url cannot be given"),
        ({"launch": "sglang"}, "openai", "launch must be vllm"),
        ({"launch_options": {"x": 1}}, "openai", "launch_options needs launch: vllm"),
        ({"launch": "vllm", "launch_options": [1]}, "openai", "launch_options must be a mapping"),
    ]:
        with pytest.raises(ConfigError, match=r"agent.runtime_options.*" + msg):
            _agent(runtime=runtime, runtime_options=opts)
    smoke = RunConfig.load("params/smoke-vllm.yaml")
    assert smoke.agent.runtime == "openai" and smoke.agent.runtime_options["launch"] == "vllm"
    assert servers.configured_servers(smoke) == []         # nothing to contact before the run: memtoc starts it


def test_the_stage_gets_the_launched_servers_address(monkeypatch, tmp_path):
    """``served``: without launch the configuration is passed through; with it, the runtime options
    name the started server (vLLM, its URL, the served name, the prepared weights' hash) and no launch
    key reaches the runtime; SmolLM2's text-rendered tools get no tool parser. The server stops after."""
    cfg = RunConfig.load("params/smoke-vllm.yaml", overrides={"output_root": str(tmp_path)})
    plain = RunConfig.load("params/smoke.yaml")
    with serving.served(plain, "smollm2-135m-instruct") as same:
        assert same is plain
    seen = {}

    class Fake:
        def __init__(self, command, port, log_path, **kw):
            seen.update(command=command, log=log_path, closed=False)
            self.base_url = f"http://127.0.0.1:{port}/v1"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen["closed"] = True
    monkeypatch.setattr(serving, "VLLMServer", Fake)
    with serving.served(cfg, "smollm2-135m-instruct", log=lambda m: None) as mcfg:
        opts = mcfg.agent.runtime_options
        assert opts["server"] == "vllm" and opts["base_url"].startswith("http://127.0.0.1:")
        assert opts["served_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and len(opts["weights_hash"]) == 64
        assert not set(opts) & set(serving.LAUNCH_KEYS) and not seen["closed"]
        assert mcfg.agent.protocols == cfg.agent.protocols and mcfg.run_dir == cfg.run_dir
    assert seen["closed"] and "--tool-call-parser" not in seen["command"]
    assert seen["log"] == cfg.paths.agent("smollm2-135m-instruct") / "server.log"
