"""The agent runtime's server, started by memtoc where ``agent.runtime_options.launch: vllm`` asks
for it: one vLLM OpenAI-compatible server per model (vLLM serves one base model per server), on a free
port of 127.0.0.1, for as long as that model's episodes and arms run.

The server gets the model's prepared weights (their hash goes into the runtime's cache identity),
the run's dtype, the name the runtime asks for (``served_model``, default the registry's hub id) and
the tool-call parser of the model's tool format where vLLM reads that format natively
(:data:`memtoc.generation.backends.vllmserver.NATIVE_PARSERS`). ``launch_options`` add any server
argument (``{max_model_len: 4096, enforce_eager: true}`` -> ``--max-model-len 4096
--enforce-eager``). The log is ``agent/<model>/server.log``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

from memtoc.config.runconfig import RunConfig
from memtoc.generation import models
from memtoc.generation.backends.vllmserver import NATIVE_PARSERS, VLLMServer, free_port, server_command
from memtoc.generation.hardware import gpu_capability
from memtoc.generation.weights import weights_hash
from memtoc.stages.agent.parsers import format_for, get_format

#: runtime options that only the launch reads (the runtime never sees them)
LAUNCH_KEYS = ("launch", "launch_options")


@contextmanager
def served(cfg: RunConfig, model: str, log=print) -> Iterator[RunConfig]:
    """``cfg`` itself, or (``agent.runtime_options.launch: vllm``) ``cfg`` with the agent runtime pointed
    at a vLLM server started for ``model`` now and stopped when the block ends."""
    opts = dict(cfg.agent.runtime_options)
    if opts.get("launch") is None:
        yield cfg
        return
    spec = models.get_model(model)
    path = models.prepare_model(model, cache_dir=cfg.model_cache_dir)
    name = opts.get("served_model") or spec.hub_id or spec.name
    fmt = get_format(opts["tool_format"]) if opts.get("tool_format") else format_for(
        [spec.name, spec.hub_id or "", spec.label, name], spec.chat if opts.get("chat") is None else bool(opts["chat"]))
    parser = fmt.name if fmt.native and fmt.name in NATIVE_PARSERS else None
    port = free_port()
    cmd = server_command(path, name, port, cfg.dtype, parser, cuda=gpu_capability() is not None,
                         options=opts.get("launch_options"))
    log_path = cfg.paths.agent(model) / "server.log"
    log(f"{model}: starting vLLM's server on port {port} (tool parser: {parser or 'none, tools rendered as text'}; "
        f"log {log_path})")
    with VLLMServer(cmd, port, log_path) as srv:
        run_opts = {k: v for k, v in opts.items() if k not in LAUNCH_KEYS}
        run_opts.update(base_url=srv.base_url, server="vllm", served_model=name,
                        weights_hash=run_opts.get("weights_hash") or weights_hash(path, cfg.model_cache_dir))
        yield replace(cfg, agent=replace(cfg.agent, runtime_options=run_opts))
