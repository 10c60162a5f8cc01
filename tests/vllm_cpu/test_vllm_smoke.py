"""The smoke pipeline on vLLM (``params/smoke-vllm.yaml``) in the vLLM environment: 01-09 pass, with
02/03/06 on the offline engine, 04's adapters served through ``LoRARequest`` on the untreated model's
engine (no merge), and 07 on vLLM's OpenAI server, which memtoc starts and stops; ``memtoc verify``
passes on it. Then the transformers smoke run of 01-04, both in float32 (``--set dtype=float32``: what
``auto`` is on a CPU without bf16 instructions, forced so that the comparison means the same on every
CPU): every reply is equal, and so are the numbers computed from them. A difference prints the first
differing episode.

``MEMTOC_SMOKE_VLLM_ROOT=DIR`` runs both in ``DIR`` (``DIR/vllm``, ``DIR/hf``) instead of a temporary
folder: a second run there is served from the generation cache, so the checks can be repeated on
finished runs in minutes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm-env builds .venv-vllm)")

from memtoc.core.project import REPO_ROOT  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_pipeline, pytest.mark.integration]
MODEL = "smollm2-135m-instruct"


def _memtoc(*args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    return subprocess.run([sys.executable, "-m", "memtoc", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _replies(run_dir: Path, pattern: str) -> dict[tuple[str, str], str]:
    """``{(file, episode or question key): reply}`` of the scored files matching ``pattern``."""
    out = {}
    for p in sorted(run_dir.glob(pattern)):
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                key = r.get("episode_id") or f"{r.get('variant')}/{r.get('formulation')}/{r.get('qkey')}"
                out[(p.name, key)] = r["response"]
    return out


def _compare(what: str, a: dict, b: dict) -> int:
    assert a.keys() == b.keys(), f"{what}: different episodes"
    diff = [k for k in a if a[k] != b[k]]
    print(f"{what}: {len(a) - len(diff)}/{len(a)} replies identical (vLLM vs transformers, float32)")
    if diff:
        k = diff[0]
        print(f"  first difference {k}: vLLM {a[k]!r}\n  transformers {b[k]!r}")
    return len(diff)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    given = os.environ.get("MEMTOC_SMOKE_VLLM_ROOT")
    root = Path(given) if given else tmp_path_factory.mktemp("smoke")
    r = _memtoc("run", "params/smoke-vllm.yaml", "--set", f"output_root={root / 'vllm'}", "--set", "dtype=float32")
    assert r.returncode == 0, f"memtoc run params/smoke-vllm.yaml failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    t = _memtoc("run", "params/smoke.yaml", "--only", "01", "02", "03", "04", "--set", f"output_root={root / 'hf'}",
                "--set", "dtype=float32")
    assert t.returncode == 0, f"the transformers smoke run failed:\n{t.stdout[-4000:]}\n{t.stderr[-4000:]}"
    return root / "vllm" / "smoke-vllm", root / "hf" / "smoke"


def test_every_notebook_runs_on_vllm_and_verifies(runs):
    rd, _ = runs
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["status"] == "ok" and all(n["status"] == "ok" for n in cfg["notebooks"]) and len(cfg["notebooks"]) == 9
    v = _memtoc("verify", str(rd))
    assert v.returncode == 0, f"memtoc verify failed:\n{v.stdout[-4000:]}\n{v.stderr[-2000:]}"
    # 04: every reply through vLLM, the adapters on the untreated model's engine (LoRA serving, no merge)
    ft = json.loads((rd / "summaries" / "finetuning.json").read_text())
    assert ft["eval_generator"]["backend"] == "vllm" and ft["eval_generator"]["enable_lora"] is True
    gens = {p.parent.name for p in (rd / "generations").rglob("*.jsonl")}
    assert {f"{MODEL}__{o}__fold{k}" for o in ("sft", "dpo") for k in (0, 1)} <= gens, gens
    # 07: on vLLM's server, started by memtoc, with the protocols a server honours for SmolLM2
    ag = json.loads((rd / "summaries" / "agent.json").read_text())
    block = ag["models"][MODEL]
    assert json.dumps(block).count('"server": "vllm"') >= 1, "07 did not run on vLLM's server"
    assert (rd / "agent" / MODEL / "server.log").stat().st_size > 0


def test_headline_numbers_equal_where_the_replies_are_equal(runs):
    rv, rt = runs
    n_diff = _compare("02/03 with-tool and closed-book", _replies(rv, f"scored/{MODEL}/*.jsonl"),
                      _replies(rt, f"scored/{MODEL}/*.jsonl"))
    ev = json.loads((rv / "summaries" / "evaluation.json").read_text())["models"][MODEL]
    et = json.loads((rt / "summaries" / "evaluation.json").read_text())["models"][MODEL]
    if n_diff == 0:
        assert ev["headline"] == et["headline"], "equal replies, different headline numbers"
    n_ad = _compare("04 adapters (served vs merged)", _replies(rv, f"adapters/{MODEL}/*/fold*/scored.jsonl"),
                    _replies(rt, f"adapters/{MODEL}/*/fold*/scored.jsonl"))
    fv = json.loads((rv / "summaries" / "finetuning.json").read_text())["models"][MODEL]["objectives"]
    ftf = json.loads((rt / "summaries" / "finetuning.json").read_text())["models"][MODEL]["objectives"]
    if n_diff == 0 and n_ad == 0:
        assert fv == ftf, "equal replies, different fine-tuning deltas"
    # the parity tests (tests/vllm_cpu/test_vllm_cpu.py) find every reply equal in float32: so must this run
    assert n_diff == 0 and n_ad == 0
