"""A minimal OpenAI-compatible server on top of the transformers backend (stdlib ``http.server``).

    python -m memtoc.generation.backends.serve smollm2-135m-instruct --host 127.0.0.1 --port 8000

Why it exists: ``transformers serve`` (transformers 5.x) needs FastAPI and Uvicorn
(``transformers[serving]``), which are not dependencies of memtoc, and it applies the raw chat
template (SmolLM2's injects a default system prompt). This server needs nothing extra and formats
prompts with memtoc's rule, so it returns exactly what ``backend="transformers"`` generates; it is
what the tests start to exercise the ``openai`` backend end to end.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (one user message,
no system message; ``temperature`` must be 0 or absent; ``max_tokens``). Concurrent requests are
collected into batches of up to ``--batch-size`` (micro-batching, 20 ms window).
"""
from __future__ import annotations

import argparse
import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from memtoc.generation.models import load_generator


class _Job:
    def __init__(self, prompt: str, max_tokens: int):
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.done = threading.Event()
        self.reply = None
        self.error: Optional[str] = None


class Engine:
    """Owns the generator; one worker thread drains the queue in micro-batches."""

    def __init__(self, generator, batch_size: int = 8, window_s: float = 0.02):
        self.gen = generator
        self.batch_size = batch_size
        self.window_s = window_s
        self.q: "queue.Queue[_Job]" = queue.Queue()
        self.worker = threading.Thread(target=self._run, daemon=True)
        self.worker.start()

    def submit(self, prompt: str, max_tokens: int) -> _Job:
        job = _Job(prompt, max_tokens)
        self.q.put(job)
        job.done.wait()
        return job

    def _run(self) -> None:
        while True:
            jobs = [self.q.get()]
            deadline = time.monotonic() + self.window_s
            while len(jobs) < self.batch_size:
                try:
                    jobs.append(self.q.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            by_len: dict[int, list[_Job]] = {}
            for j in jobs:
                by_len.setdefault(j.max_tokens, []).append(j)
            for mt, group in by_len.items():
                try:
                    self.gen.max_new_tokens = mt
                    replies = self.gen.generate([j.prompt for j in group])
                    for j, r in zip(group, replies):
                        j.reply = r
                except Exception as e:  # report to the clients, keep serving
                    for j in group:
                        j.error = f"{type(e).__name__}: {e}"
                for j in group:
                    j.done.set()


def make_handler(engine: Engine, served_name: str, default_max_tokens: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet
            pass

        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, msg: str) -> None:
            self._send(code, {"error": {"message": msg, "type": "invalid_request_error", "code": code}})

        def do_GET(self):
            if self.path.rstrip("/") in ("/health", "/v1/health"):
                return self._send(200, {"status": "ok"})
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [
                    {"id": served_name, "object": "model", "owned_by": "memtoc"}]})
            self._error(404, f"unknown path {self.path}")

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._error(404, f"unknown path {self.path}; this server offers /v1/chat/completions")
            try:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
            except ValueError as e:
                return self._error(400, f"body is not JSON: {e}")
            if body.get("model") not in (None, served_name):
                return self._error(404, f"model {body.get('model')!r} is not served here; served: {served_name}")
            msgs = body.get("messages")
            if not (isinstance(msgs, list) and len(msgs) == 1 and isinstance(msgs[0], dict)
                    and msgs[0].get("role") == "user" and isinstance(msgs[0].get("content"), str)):
                return self._error(400, "messages must be exactly one user message with string content "
                                        "(no system message)")
            if float(body.get("temperature", 0) or 0) != 0:
                return self._error(400, "only greedy decoding is served: temperature must be 0")
            if body.get("stream"):
                return self._error(400, "streaming is not supported")
            mt = int(body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens)
            job = engine.submit(msgs[0]["content"], mt)
            if job.error:
                return self._error(500, job.error)
            r = job.reply
            finish = {"eos": "stop", "final_line": "stop"}.get(r.finish, "length")
            self._send(200, {
                "id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion",
                "created": int(time.time()), "model": served_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": r.n_prompt_tokens, "completion_tokens": r.n_new_tokens,
                          "total_tokens": r.n_prompt_tokens + r.n_new_tokens}})

    return Handler


def serve(name: str, host: str = "127.0.0.1", port: int = 8000, served_name: Optional[str] = None,
          batch_size: int = 8, dtype: str = "auto", max_new_tokens: int = 48, stop_at_final: bool = True,
          model_cache_dir: Optional[str] = None) -> ThreadingHTTPServer:
    gen = load_generator(name, backend="transformers", batch_size=batch_size, dtype=dtype,
                         max_new_tokens=max_new_tokens, stop_at_final=stop_at_final,
                         model_cache_dir=model_cache_dir, show_progress=False)
    engine = Engine(gen, batch_size=batch_size)
    httpd = ThreadingHTTPServer((host, port), make_handler(engine, served_name or name, max_new_tokens))
    return httpd


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtoc.generation.backends.serve",
                                 description="minimal OpenAI-compatible server (transformers backend)")
    ap.add_argument("model", help="registry name or local HF directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-name", default=None, help="model id clients send (default: MODEL)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    ap.add_argument("--max-new-tokens", type=int, default=48, help="default when a request has no max_tokens")
    ap.add_argument("--no-stop-at-final", action="store_true", help="generate up to max_tokens/EOS")
    ap.add_argument("--model-cache-dir", default=None)
    a = ap.parse_args(argv)
    httpd = serve(a.model, a.host, a.port, a.served_name, a.batch_size, a.dtype, a.max_new_tokens,
                  not a.no_stop_at_final, a.model_cache_dir)
    print(f"serving {a.served_name or a.model} on http://{a.host}:{httpd.server_address[1]}/v1", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
