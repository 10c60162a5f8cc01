"""Every configured OpenAI-compatible server is contacted before the first notebook (memtoc.run.servers)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from memtoc import cli
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.run import servers


class _Models(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path.endswith("/v1/models")
        body = json.dumps({"object": "list", "data": [{"id": "m"}]} if ok else {}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def live_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def _dead_url():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                      # nothing listens there now
    return f"http://127.0.0.1:{port}/v1"


def test_every_configured_server_is_listed():
    p = {"backend": "openai", "backend_options": {"base_url": "http://a/v1/"},
         "judge": {"model": "judge-model", "backend": "openai", "backend_options": {"base_url": "http://b/v1"}},
         "agent": {"enabled": True, "runtime": "openai", "runtime_options": {"base_url": "http://c/v1"}}}
    got = [(s.setting, s.base_url) for s in servers.configured_servers(RunConfig.of(p))]
    assert got == [("backend_options.base_url", "http://a/v1"), ("judge.backend_options.base_url", "http://b/v1"),
                   ("agent.runtime_options.base_url", "http://c/v1")]
    assert servers.configured_servers(RunConfig.of({"backend": "transformers", "agent": {"enabled": False, "runtime": "openai"}})) == []


def test_a_live_server_passes_and_a_dead_one_is_one_line(live_url):
    assert servers.check_servers(RunConfig.of({"backend": "openai", "backend_options": {"base_url": live_url}}), "p.yaml")
    dead = _dead_url()
    with pytest.raises(ConfigError) as e:
        servers.check_servers(RunConfig.of({"backend": "transformers", "agent": {"runtime": "openai",
                              "runtime_options": {"base_url": dead}}}), "p.yaml", timeout=2)
    msg = str(e.value)
    assert msg.startswith(f"p.yaml: agent.runtime_options.base_url: {dead} did not answer") and "\n" not in msg


def test_a_wrong_path_is_named(live_url):
    with pytest.raises(ConfigError, match="HTTP 404"):
        servers.check_servers(RunConfig.of({"backend": "openai", "backend_options": {"base_url": live_url + "/x"}}), "p.yaml")


def test_run_with_a_dead_server_fails_in_seconds_before_01(tmp_path, capsys):
    dead = _dead_url()
    t0 = time.perf_counter()
    rc = cli.main(["run", "params/smoke.yaml", "--set", f"output_root={tmp_path}", "--set", "agent.runtime=openai",
                   "--set", f"agent.runtime_options={{base_url: {dead}}}"])
    err = capsys.readouterr().err
    assert rc != 0 and f"agent.runtime_options.base_url: {dead} did not answer" in err
    assert time.perf_counter() - t0 < 30 and not any(tmp_path.iterdir())   # no run directory, no notebook


def test_dry_run_reports_the_servers(live_url, capsys):
    dead = _dead_url()
    rc = cli.main(["run", "params/smoke.yaml", "--dry-run", "--set", "backend=openai",
                   "--set", f"backend_options={{base_url: {live_url}}}", "--set", "agent.runtime=openai",
                   "--set", f"agent.runtime_options={{base_url: {dead}}}"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{live_url}: answers" in out and f"{dead}: DID NOT ANSWER" in out
