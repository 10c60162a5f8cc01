"""The training dtype follows the hardware: trl's mixed precision is set from the resolved dtype (its
configs default to ``bf16=True`` even on a CPU, which autocasts every step to emulated bf16 on a CPU
without bf16 instructions: ~30x slower), ``auto`` resolves like the generation dtype, and the
resolved dtype is part of an adapter's identity and record."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.generation import hardware as gpuenv
from memtoc.stages import finetune as F


def _ft(**over):
    return RunConfig.of(load_params(None, overrides={"finetune": over} if over else None)).finetune


@pytest.mark.parametrize("native, expect", [("0", "float32"), ("1", "bfloat16")])
def test_auto_train_dtype_follows_the_cpu(monkeypatch, native, expect):
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, native)
    ft = _ft()
    assert ft.train_dtype == "auto"                        # the default
    assert F.train_dtype(ft, cuda=False) == expect
    assert F.training_config(ft, cuda=False)["train_dtype"] == expect


def test_auto_train_dtype_on_a_gpu_is_bf16_where_the_gpu_has_it(monkeypatch):
    import torch
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "0")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert F.train_dtype(_ft(), cuda=True) == "bfloat16"
    # a T4 / V100 (no bf16): float32, which the loader and the trainer know (float16 weights would need
    # loss scaling; "float16" here stopped load_train_model with a KeyError)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert F.train_dtype(_ft(), cuda=True) == "float32"


@pytest.mark.parametrize("native", ["0", "1"])
def test_the_trainer_mixed_precision_is_the_resolved_dtype(monkeypatch, tmp_path, native):
    """trl's own default (bf16=True) never reaches the trainer: float32 training computes in float32."""
    from trl import DPOConfig, SFTConfig
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, native)
    for ft in (_ft(), _ft(train_dtype="float32"), _ft(train_dtype="bfloat16")):
        want = F.train_dtype(ft, cuda=False) == "bfloat16"
        kw = F.training_arguments(ft, tmp_path, progress=False, cuda=False)
        assert kw["bf16"] is want and kw["fp16"] is False
        for cls in (SFTConfig, DPOConfig):
            args = cls(**kw)
            assert args.bf16 is want and args.fp16 is False, (cls.__name__, ft.train_dtype, native)
    assert SFTConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is True   # what trl would do without it


def test_explicit_bf16_on_an_emulating_cpu_warns_once_with_the_cost(monkeypatch):
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "0")
    monkeypatch.setattr(gpuenv, "_WARNED", set())
    ft = _ft(train_dtype="bfloat16")
    with pytest.warns(UserWarning, match="emulated.*30x"):
        assert F.train_dtype(ft, cuda=False) == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.train_dtype(ft, cuda=False)                           # once only
        F.train_dtype(_ft(), cuda=False)                        # auto never warns
        monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "1")
        monkeypatch.setattr(gpuenv, "_WARNED", set())
        F.train_dtype(ft, cuda=False)                           # native bf16: no warning


def test_the_adapter_identity_names_the_resolved_dtype(monkeypatch):
    """On a CPU with bf16 instructions ``auto`` keeps the identity of the old ``bfloat16`` default (its
    adapters resume); elsewhere it names float32 (a different computation, a different adapter)."""
    rows = [{"prompt": "p", "completion": "c"}]
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "1")
    bf16_auto = F.config_hash("sft", _ft(), "w", rows)
    assert bf16_auto == F.config_hash("sft", _ft(train_dtype="bfloat16"), "w", rows)
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "0")
    f32_auto = F.config_hash("sft", _ft(), "w", rows)
    assert f32_auto == F.config_hash("sft", _ft(train_dtype="float32"), "w", rows) != bf16_auto


def test_train_dtype_is_checked():
    with pytest.raises(ConfigError, match="train_dtype.*auto"):
        _ft(train_dtype="half")


def test_cpu_kind_and_the_override(monkeypatch):
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "0")
    kind = gpuenv.cpu_kind()
    assert kind["native_bf16"] is False and not kind["name"].endswith("-bf16") and kind["bf16_forced"] == "0"
    assert kind["capability"] and kind["name"] == kind["capability"].lower().replace("_", "-")
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "1")
    assert gpuenv.cpu_kind()["name"].endswith("-bf16")
    monkeypatch.setenv(gpuenv.CPU_BF16_ENV, "yes")
    with pytest.raises(ConfigError, match="MEMTOC_CPU_BF16 must be 0 or 1"):
        gpuenv.cpu_has_native_bf16()


def test_the_run_records_the_cpu_kind():
    from memtoc.run.pipeline import provenance
    prov = provenance(RunConfig.of(load_params(None)))
    assert prov["cpu"]["name"] and "native_bf16" in prov["cpu"]
