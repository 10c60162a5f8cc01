"""The runtime on an OpenAI-compatible server (``vllm serve MODEL --enable-auto-tool-choice
--tool-call-parser <family>`` is the paper's stack); replies cached through :class:`.caching.ReplyCache`."""
from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

from memtoc.generation import cache as _cache, models
from memtoc.generation.backends.openai import BackendError, post_json
from memtoc.stages.agent.parsers import RAW_STOP, Parsed, ToolCall, cut_at_stop, format_for, get_format
from memtoc.stages.agent.runtime.base import (
    CONSTRAINED,
    AgentRuntimeError,
    ChatRequest,
    ChatResponse,
    Runtime,
    args_dict,
)
from memtoc.stages.agent.runtime.caching import SERVER_FILE, ReplyCache, server_key
from memtoc.stages.agent.runtime.render import parse_reply, raw_transcript, text_messages

SERVERS = ("auto", "vllm", "transformers", "other")


def detect_server(base_url: str, session=None, timeout: float = 10.0) -> str:
    """``vllm`` | ``transformers`` | ``other``, from the server's OpenAPI paths (FastAPI serves
    ``/openapi.json``): vLLM has ``/tokenize`` and ``/version``, ``transformers serve`` ``/load_model`` or
    ``/v1/systemone``. vLLM is checked first: vLLM 0.32 serves ``/v1/systemone`` too."""
    s = session or requests
    root = re.sub(r"/v1/?$", "", base_url.rstrip("/"))
    try:
        r = s.get(root + "/openapi.json", timeout=timeout)
        paths = set((r.json() or {}).get("paths", {})) if r.status_code == 200 else set()
    except (requests.RequestException, ValueError):
        paths = set()
    if {"/tokenize", "/version"} <= paths or "/v1/tokenize" in paths:
        return "vllm"
    if {"/load_model", "/v1/systemone"} & paths:
        return "transformers"
    return "other"


class OpenAIRuntime(Runtime):
    """A runtime on an OpenAI-compatible server (see the module docstring).

    Options: ``base_url`` (default ``$OPENAI_BASE_URL`` or ``http://127.0.0.1:8000/v1``), ``api_key``,
    ``served_model`` (the name the server knows; default the registry hub id, else the name given),
    ``server`` (auto | vllm | transformers | other), ``honors_tool_choice`` (None: vLLM only),
    ``tool_format``, ``chat`` (None: the registry's), ``timeout``, ``max_retries``, ``backoff``,
    ``concurrency``, ``weights_hash`` (into the cache identity), ``seed``, ``temperature`` (0: greedy,
    the default; > 0 with ``seed``: the paper's T = 0.7 sampling rerun, vLLM's per-request seed)."""

    kind = "openai"

    def __init__(self, model: str, max_tokens_per_call: int = 64, cache_dir: str | os.PathLike | None = None,
                 base_url: Optional[str] = None, api_key: Optional[str] = None, served_model: Optional[str] = None,
                 server: str = "auto", honors_tool_choice: Optional[bool] = None, tool_format: Optional[str] = None,
                 chat: Optional[bool] = None, timeout: float = 120.0, max_retries: int = 4, backoff: float = 1.0,
                 concurrency: int = 4, weights_hash: Optional[str] = None, seed: Optional[int] = None,
                 temperature: float = 0.0):
        if server not in SERVERS:
            raise AgentRuntimeError(f"agent runtime option server must be one of {', '.join(SERVERS)}, got {server!r}")
        try:
            self.spec = models.get_model(model)
        except models.ModelError:
            self.spec = models.ModelSpec(model, re.sub(r"[^A-Za-z0-9_.-]+", "_", model), "remote", chat=True,
                                         system_turn="template")
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000/v1").rstrip("/")
        self.served_model = served_model or self.spec.hub_id or self.spec.name
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {api_key or os.environ.get('OPENAI_API_KEY') or 'EMPTY'}",
                                     "Content-Type": "application/json"})
        self.timeout, self.max_retries, self.backoff = float(timeout), int(max_retries), float(backoff)
        self.concurrency = max(1, int(concurrency))
        self.max_tokens_per_call = int(max_tokens_per_call)
        self.seed = seed
        self.temperature = float(temperature)
        # the body's value: 0 (an int, as always) when greedy, so greedy request bodies - and the cache
        # keys hashed from them - are byte-identical to the ones written before sampling existed
        self.body_temperature: float | int = self.temperature if self.temperature > 0 else 0
        if self.temperature < 0:
            raise AgentRuntimeError(f"agent runtime option temperature must be >= 0, got {temperature!r}")
        self.chat_model = self.spec.chat if chat is None else bool(chat)
        self.format = get_format(tool_format) if tool_format else format_for(
            [self.spec.name, self.spec.hub_id or "", self.spec.label, self.served_model], self.chat_model)
        self.server = detect_server(self.base_url, self.session) if server == "auto" else server
        honours = (self.server == "vllm") if honors_tool_choice is None else bool(honors_tool_choice)
        self.honors_tool_choice = honours
        self.named_tool_choice = honours and self.format.native and self.chat_model
        self.enforces_none = honours and self.format.native and self.chat_model
        self.constrained = False
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache = ReplyCache(None if self.cache_dir is None else self.cache_dir / SERVER_FILE)
        self.identity = {"model": self.spec.name, "served_model": self.served_model, "weights_sha256": weights_hash,
                         "backend": "openai", "server": self.server, "tool_format": self.format.name,
                         "chat": self.chat_model, "honors_tool_choice": honours, "seed": seed, "greedy": True}
        if self.temperature > 0:            # greedy identities (and their cache keys) stay as they were
            self.identity.update(greedy=False, temperature=self.temperature)

    def why_not(self, need: str) -> str:
        if need == CONSTRAINED:
            return ("a server cannot constrain only the arguments of a call the model chose to make; the repair arm "
                    "runs in-process (agent.runtime: transformers)")
        text = (f"memtoc renders the tools of {self.spec.name} as text ({self.format.name} format), so no server "
                "can force its call")
        if not self.honors_tool_choice:
            return (f"the server at {self.base_url} is {self.server!r}, which does not honour tool_choice"
                    + (" (transformers serve ignores it and only logs 'Ignoring unsupported fields')"
                       if self.server == "transformers" else "; pass honors_tool_choice: true if it does")
                    + ("" if self.format.native and self.chat_model else "; moreover " + text))
        return text

    # -- request bodies ----------------------------------------------------------------------------
    def request_body(self, req: ChatRequest) -> tuple[str, dict[str, Any]]:
        if not self.chat_model:
            body: dict[str, Any] = {"model": self.served_model, "prompt": raw_transcript(req.messages, req.tools, self.format),
                                    "temperature": self.body_temperature, "max_tokens": int(req.max_tokens), "n": 1, "stream": False,
                                    "stop": list(RAW_STOP)}
            path = "/completions"
        elif self.format.native:
            msgs = [{k: v for k, v in m.items() if k != "raw"} for m in req.messages]
            body = {"model": self.served_model, "messages": msgs, "temperature": self.body_temperature,
                    "max_tokens": int(req.max_tokens), "n": 1, "stream": False}
            if req.tools:
                body["tools"] = req.tools
                if self.honors_tool_choice:
                    body["tool_choice"] = req.tool_choice
            path = "/chat/completions"
        else:
            body = {"model": self.served_model, "messages": text_messages(req.messages, req.tools, self.format),
                    "temperature": self.body_temperature, "max_tokens": int(req.max_tokens), "n": 1, "stream": False}
            path = "/chat/completions"
        if self.seed is not None:
            body["seed"] = self.seed
        return path, body

    def _post(self, path: str, body: dict) -> dict:
        return post_json(self.session, self.base_url + path, body, self.timeout, self.max_retries, self.backoff,
                         f"served_model={self.served_model!r}")

    def _one(self, req: ChatRequest) -> ChatResponse:
        path, body = self.request_body(req)
        key = server_key(self.identity, body)
        rec = self.cache.get(key)
        cached = rec is not None
        if rec is None:
            t0 = time.perf_counter()
            data = self._post(path, body)
            rec = {"key": key, "text": "", "response": data, "seconds": round(time.perf_counter() - t0, 6)}
            choice = (data.get("choices") or [{}])[0]
            rec["text"] = (choice.get("text") if not self.chat_model else (choice.get("message") or {}).get("content")) or ""
            self.cache.put([rec])
        return self.response_from(rec["response"], req, cached, float(rec.get("seconds", 0.0)),
                                  _cache.sha256_text(_cache.canonical_json(body)))

    def response_from(self, data: dict, req: ChatRequest, cached: bool = False, seconds: float = 0.0,
                      body_sha256: Optional[str] = None) -> ChatResponse:
        """A :class:`ChatResponse` from a server's JSON answer."""
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise BackendError(f"{self.base_url}: unexpected response {str(data)[:300]}") from None
        usage = data.get("usage") or {}
        finish = choice.get("finish_reason") or ""
        if not self.chat_model:
            text, _ = cut_at_stop(choice.get("text") or "", RAW_STOP)
            p = parse_reply(self.format, text, req.tool_choice)
        else:
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            server_calls = msg.get("tool_calls") or []
            if server_calls and req.tool_choice != "none" or (server_calls and not self.enforces_none):
                calls = [ToolCall(tc.get("function", {}).get("name"), args_dict(tc.get("function", {}).get("arguments")),
                                  json.dumps(tc.get("function", {}), ensure_ascii=False)) for tc in server_calls]
                p = Parsed(text.strip(), calls, None, True)
            else:
                p = parse_reply(self.format, text, req.tool_choice if self.enforces_none else "auto")
        ignored = req.tool_choice == "none" and not p.calls and self.format.parse(text).opened
        return ChatResponse(text, p.content, p.calls, p.error, p.opened, int(usage.get("prompt_tokens") or 0),
                            int(usage.get("completion_tokens") or 0), finish, cached, seconds, body_sha256,
                            call_text_ignored=ignored)

    def chat_many(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        requests = list(requests)
        if self.concurrency == 1 or len(requests) == 1:
            return [self._one(r) for r in requests]
        with ThreadPoolExecutor(self.concurrency) as ex:
            return list(ex.map(self._one, requests))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(model=self.spec.name, served_model=self.served_model, base_url=self.base_url, server=self.server,
                 honors_tool_choice=self.honors_tool_choice, tool_format=self.format.name, chat=self.chat_model,
                 max_tokens_per_call=self.max_tokens_per_call)
        return d

    def close(self) -> None:
        self.session.close()

