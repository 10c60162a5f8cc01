"""memtoc gpucheck at tiny sizes on the CPU: the same code the GPU run executes (the paper's four
architectures through memtoc's transformers loader against an eager reference, a DPO step through
memtoc's trainer), and a check that its comparisons can fail."""
import json

import pytest

from memtoc import cli
from memtoc.run import gpucheck


def test_gpucheck_tiny_cpu_passes(tmp_path, capsys):
    out = tmp_path / "gpucheck.json"
    rc = cli.main(["gpucheck", "--tiny", "--device", "cpu", "--json", str(out)])
    doc = json.loads(out.read_text())
    res = {r["name"]: r for r in doc["results"]}
    assert set(res) >= {"llama-3.1", "qwen2.5", "mistral", "gemma-2"}
    for name in ("llama-3.1", "qwen2.5", "mistral", "gemma-2"):
        r = res[name]
        assert r["status"] == "PASS", (name, r["detail"])
        assert r["metrics"]["max_logit_diff"] <= 1e-4 and r["metrics"]["replies_equal"] == "4/4"
    assert res["gemma-2"]["metrics"]["attention"] not in ("sdpa", "memtoc_cpu")   # soft-capping kept
    dpo = [r for r in doc["results"] if r["name"].startswith("dpo-step")]
    assert len(dpo) == 1
    if dpo[0]["status"] != "SKIP":                                                # skipped only without trl
        assert dpo[0]["status"] == "PASS", dpo[0]["detail"]
        m = dpo[0]["metrics"]
        assert m["steps"] == 1 and m["lora"]["lora_r"] == 16 and m["lora"]["lora_alpha"] == 32
        assert m["dpo_beta"] == 0.1 and m["batch_size"] == 8
    assert rc == 0 and "0 failed" in capsys.readouterr().out


def test_gpucheck_comparison_can_fail():
    """A tolerance below float32 rounding between memtoc's attention and eager must FAIL the case."""
    (r,) = gpucheck.run_checks(device="cpu", tiny=True, atol=1e-12, dpo=False, only=["qwen2.5"], log=lambda s: None)
    assert r.status == "FAIL" and "logits differ from eager" in r.detail
