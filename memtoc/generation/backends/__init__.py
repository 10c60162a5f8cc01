"""Generation backends: one module per backend, one line per backend in :data:`REGISTRY`.

``REGISTRY[name] = ("module:Class", local)``: ``local`` backends load the weights in this process
(``models.load_generator`` wraps them in ``base.LazyGenerator`` with the model's path); the others
talk to a server (``Class(spec, max_new_tokens=..., adapter=..., **backend_options)``). The class is
imported on first use, so an optional backend's packages (vllm) are needed only when it is chosen.
"""
from __future__ import annotations

import importlib

from memtoc.core.vocab import BACKENDS

REGISTRY: dict[str, tuple[str, bool]] = {
    "transformers": ("memtoc.generation.backends.hf:TransformersGenerator", True),
    "vllm": ("memtoc.generation.backends.vllm:VLLMGenerator", True),
    "openai": ("memtoc.generation.backends.openai:OpenAIGenerator", False),
}
assert tuple(REGISTRY) == BACKENDS, "backends.REGISTRY: one entry per vocab.BACKENDS, in that order"


def generator_class(backend: str) -> tuple[type, bool]:
    """(the Generator class of ``backend``, whether it is local)."""
    target, local = REGISTRY[backend]
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls), local
