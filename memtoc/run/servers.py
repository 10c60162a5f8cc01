"""Every OpenAI-compatible server a run is configured to use, contacted before the first notebook.

A run may talk to up to three servers: the generation backend (``backend: openai``), the judge
(``judge.backend: openai``) and the agent loop's runtime (``agent.runtime: openai``). Each is asked
for ``GET <base_url>/models`` with a short timeout before any work starts, so that a dead or wrong
``base_url`` fails ``memtoc run`` in seconds, in one line naming the setting and the URL, instead
of after the earlier notebooks have run. A server memtoc starts itself (``agent.runtime_options.launch``)
is not contacted here. ``memtoc run --dry-run`` reports the same check.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import requests

from memtoc.core.errors import ConfigError

if TYPE_CHECKING:      # annotations only: gpuenv/servers sit below the run configuration
    from memtoc.config.runconfig import RunConfig

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"   # the openai backend's and runtime's default
CHECK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Server:
    """One configured server: the setting that names it and its base URL."""

    setting: str        # e.g. "backend_options.base_url"
    base_url: str
    api_key: Optional[str] = None


def _server(options: Optional[dict], setting: str) -> Server:
    options = options or {}
    url = options.get("base_url") or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    return Server(setting, str(url).rstrip("/"), options.get("api_key"))


def configured_servers(cfg: RunConfig) -> list[Server]:
    """The servers the run's parameters name (none for a run that uses no OpenAI-compatible server)."""
    out = []
    if cfg.backend == "openai":
        out.append(_server(cfg.backend_options, "backend_options.base_url"))
    if cfg.judge is not None and cfg.judge.backend == "openai":
        out.append(_server(cfg.judge.backend_options, "judge.backend_options.base_url"))
    if cfg.agent.enabled and cfg.agent.runtime == "openai" and cfg.agent.runtime_options.get("launch") is None:
        out.append(_server(cfg.agent.runtime_options, "agent.runtime_options.base_url"))
    return out


def probe(server: Server, timeout: float = CHECK_TIMEOUT_S) -> Optional[str]:
    """None when the server answers ``GET /models`` with HTTP 200, else why not (one phrase)."""
    key = server.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    try:
        r = requests.get(server.base_url + "/models", timeout=timeout, headers={"Authorization": f"Bearer {key}"})
    except requests.Timeout:
        return f"no answer within {timeout:g} s"
    except requests.RequestException as e:
        return f"cannot connect ({type(e).__name__})"
    if r.status_code != 200:
        return f"GET /models answered HTTP {r.status_code}"
    return None


def check_servers(cfg: RunConfig, source: str = "<params>", timeout: float = CHECK_TIMEOUT_S) -> list[Server]:
    """Contact every configured server; raise one ConfigError line for the first that does not answer.
    Returns the servers checked."""
    servers = configured_servers(cfg)
    for s in servers:
        why = probe(s, timeout)
        if why:
            raise ConfigError(f"{source}: {s.setting}: {s.base_url} did not answer ({why}); start the server "
                              "(e.g. `vllm serve MODEL`) or correct the URL")
    return servers


def server_report(cfg: RunConfig, timeout: float = CHECK_TIMEOUT_S) -> list[str]:
    """``--dry-run``'s lines: each configured server and whether it answers now (nothing when none)."""
    servers = configured_servers(cfg)
    if not servers:
        return []
    lines = ["servers (contacted now; `memtoc run` refuses to start when one does not answer)"]
    for s in servers:
        why = probe(s, timeout)
        lines.append(f"  {s.setting:<34} {s.base_url}: " + ("answers" if why is None else f"DID NOT ANSWER ({why})"))
    return lines
