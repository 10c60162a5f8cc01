"""The backend registry (memtoc.generation.backends.REGISTRY) and the abstract Generator."""
from __future__ import annotations

import pytest

from memtoc.config.runconfig import RunConfig
from memtoc.core import vocab
from memtoc.core.errors import ConfigError
from memtoc.generation import backends
from memtoc.generation.backends.base import Generator
from memtoc.generation.models import load_generator


def test_one_registry_line_per_backend_of_the_vocabulary():
    assert tuple(backends.REGISTRY) == vocab.BACKENDS
    for name in ("transformers", "openai"):           # vllm is an optional extra (GPU)
        cls, local = backends.generator_class(name)
        assert issubclass(cls, Generator) and cls.backend == name and local == (name in vocab.LOCAL_BACKENDS)


def test_unknown_backend_is_an_error_in_params_and_in_load_generator():
    with pytest.raises(ConfigError, match="field 'backend'.*tgi"):
        RunConfig.of({"backend": "tgi"})
    with pytest.raises(ConfigError, match="unknown backend 'tgi'"):
        load_generator("smollm2-135m-instruct", backend="tgi")


def test_generator_is_abstract():
    with pytest.raises(TypeError):
        Generator({"model": "x"})

    class Incomplete(Generator):
        backend = "x"
    with pytest.raises(TypeError, match="_generate_batches"):
        Incomplete({"model": "x"})
