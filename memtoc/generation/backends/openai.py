"""openai backend: any OpenAI-compatible ``/v1/chat/completions`` endpoint.

Works with ``vllm serve``, ``transformers serve`` (needs ``transformers[serving]``) and
``python -m memtoc.generation.backends.serve`` (the stdlib server shipped here). One user message, no system
message; the server applies the chat template (so the prompt format is the server's: vLLM and
transformers serve use the template as is, memtoc's server applies memtoc's rule). Base models
(``chat=False`` in the registry) go to ``/v1/completions`` with the raw prompt.

Options (``load_generator(..., backend="openai", **options)``): ``base_url`` (default
``http://127.0.0.1:8000/v1``; ``$OPENAI_BASE_URL``), ``api_key`` (``$OPENAI_API_KEY``, default
"EMPTY"), ``model`` (the served model name; default: the registry hub id, else the name given),
``timeout`` (seconds per request, default 120 as in the paper's runner), ``max_retries`` (default 4;
connection errors, timeouts, HTTP 408/409/429/5xx are retried with exponential backoff
``backoff * 2**attempt`` capped at 30 s; other HTTP errors fail at once), ``backoff`` (default 1.0),
``concurrency`` (parallel requests, default 4), ``weights_hash`` (put into the cache identity; the
client cannot see the server's weights, so pass it when several weights are served under one name),
``stop_at_final`` (default True: the reply is cut after its first completed FINAL line, the same
text the transformers backend stops at).

temperature is 0 (greedy). Each reply is yielded as soon as it arrives, so the cache keeps every
finished request of a killed run.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Iterator, Optional

from tqdm.auto import tqdm

from memtoc.core.errors import MemtocError
from memtoc.generation.backends.base import Generator, Reply, truncate_reply

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class BackendError(MemtocError):
    """A generation backend failed in a way the user can fix (server down, wrong model name)."""


def build_chat_request(model: str, prompt: str, max_new_tokens: int, seed: Optional[int] = None) -> dict:
    """The JSON body of one chat request: a single user turn, no system message, greedy."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "temperature": 0, "max_tokens": int(max_new_tokens), "n": 1, "stream": False}
    if seed is not None:
        body["seed"] = seed
    return body


def build_completion_request(model: str, prompt: str, max_new_tokens: int, seed: Optional[int] = None) -> dict:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "temperature": 0,
                            "max_tokens": int(max_new_tokens), "n": 1, "stream": False}
    if seed is not None:
        body["seed"] = seed
    return body


def post_json(session, url: str, body: dict, timeout: float, max_retries: int, backoff: float,
              what: str = "the model name") -> dict:
    """POST ``body`` to ``url`` and return the JSON answer: connection errors, timeouts and HTTP
    408/409/429/5xx are retried (``backoff * 2**attempt`` s, at most 30 s); other HTTP errors fail at
    once with a BackendError naming ``what`` to check (also used by ``memtoc.stages.agent.runtime``)."""
    import requests
    last = ""
    for attempt in range(max_retries + 1):
        try:
            r = session.post(url, json=body, timeout=timeout)
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code not in RETRY_STATUS:
                raise BackendError(f"{url} refused the request ({last}); check base_url and {what}")
        except (requests.ConnectionError, requests.Timeout) as e:
            last = f"{type(e).__name__}: {e}"
        if attempt < max_retries:
            time.sleep(min(30.0, backoff * 2 ** attempt))
    raise BackendError(f"{url}: no answer after {max_retries + 1} attempts (last: {last}); is the "
                       "server running? start one with e.g. `python -m memtoc.generation.backends.serve MODEL` or "
                       "`vllm serve MODEL`, and pass base_url")


class OpenAIGenerator(Generator):
    backend = "openai"

    def __init__(self, spec, max_new_tokens: int = 48, adapter=None, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, model: Optional[str] = None, timeout: float = 120.0,
                 max_retries: int = 4, backoff: float = 1.0, concurrency: int = 4,
                 weights_hash: Optional[str] = None, stop_at_final: bool = True,
                 stop_at_first_line: bool = False, seed: Optional[int] = None,
                 show_progress: bool = True, **unused):
        import requests  # a declared dependency

        if adapter is not None:
            raise BackendError("the openai backend cannot load a LoRA adapter; serve the adapter "
                               "(e.g. `vllm serve BASE --enable-lora --lora-modules NAME=DIR`) and pass "
                               "model=NAME, or use backend='transformers'")
        if unused:
            raise BackendError(f"unknown openai backend option(s) {sorted(unused)}; valid: base_url, api_key, "
                               "model, timeout, max_retries, backoff, concurrency, weights_hash, "
                               "stop_at_final, stop_at_first_line, seed")
        self.spec = spec
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000/v1").rstrip("/")
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.model = model or spec.hub_id or spec.name
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.concurrency = max(1, int(concurrency))
        self.max_new_tokens = int(max_new_tokens)
        self.stop_at_final = bool(stop_at_final)
        self.stop_at_first_line = bool(stop_at_first_line)
        self.seed = seed
        self.show_progress = show_progress
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {self.api_key}",
                                     "Content-Type": "application/json"})
        super().__init__({
            "model": spec.name, "served_model": self.model, "weights_sha256": weights_hash,
            "adapter_sha256": None, "backend": self.backend,
            "prompt_format": {"chat": spec.chat, "system_turn": "server"},
            "decoding": {"greedy": True, "max_new_tokens": self.max_new_tokens,
                         "stop_at_final": self.stop_at_final, "seed": seed,
                         **({"stop_at_first_line": True} if self.stop_at_first_line else {})},
        })

    def request_body(self, prompt: str) -> tuple[str, dict]:
        if self.spec.chat:
            return "/chat/completions", build_chat_request(self.model, prompt, self.max_new_tokens, self.seed)
        return "/completions", build_completion_request(self.model, prompt, self.max_new_tokens, self.seed)

    def _post(self, path: str, body: dict) -> dict:
        return post_json(self.session, self.base_url + path, body, self.timeout, self.max_retries, self.backoff,
                         f"model={self.model!r}")

    def _one(self, prompt: str) -> Reply:
        path, body = self.request_body(prompt)
        t0 = time.perf_counter()
        data = self._post(path, body)
        dt = time.perf_counter() - t0
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.spec.chat else choice["text"].strip()
        except (KeyError, IndexError, TypeError):
            raise BackendError(f"{self.base_url}{path}: unexpected response {str(data)[:300]}") from None
        text = text or ""
        finish = choice.get("finish_reason") or ""
        cut, rule = truncate_reply(text, self.stop_at_final, self.stop_at_first_line)
        if rule and cut != text:
            text, finish = cut, rule
        usage = data.get("usage") or {}
        return Reply(text=text, n_prompt_tokens=int(usage.get("prompt_tokens") or 0),
                     n_new_tokens=int(usage.get("completion_tokens") or 0), seconds=dt, key="",
                     cached=False, finish=finish)

    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        bar = tqdm(total=len(prompts), desc=desc or f"generate {self.spec.label}", unit="req",
                   disable=not self.show_progress, leave=False)
        try:
            if self.concurrency == 1:
                for i, p in enumerate(prompts):
                    r = self._one(p)
                    bar.update(1)
                    yield [i], [r]
                return
            with ThreadPoolExecutor(self.concurrency) as ex:
                futs = {ex.submit(self._one, p): i for i, p in enumerate(prompts)}
                try:
                    for f in as_completed(futs):
                        r = f.result()
                        bar.update(1)
                        yield [futs[f]], [r]
                finally:
                    for f in futs:
                        f.cancel()
        finally:
            bar.close()

    def close(self) -> None:
        self.session.close()
