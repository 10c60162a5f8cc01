"""Published lenses by name (probes.lens_files): downloaded once from a local HTTP server, the
sha256 recorded and checked on reuse; the caveat text per model."""
from __future__ import annotations

import functools
import hashlib
import http.server
import threading

import pytest
import torch

from memtoc.generation import models
from memtoc.stages.probes import core, lens as L, lensfiles as LF


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    torch.save({"J": {1: torch.eye(4)}, "n_prompts": 3, "source_layers": [1], "d_model": 4}, root / "m_jacobian_lens.pt")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_download_once_record_and_reuse(server, tmp_path):
    root, base = server
    url = f"{base}/m_jacobian_lens.pt"
    sha = hashlib.sha256((root / "m_jacobian_lens.pt").read_bytes()).hexdigest()
    src = LF.resolve(url, tmp_path / "cache", "probes.lens_files.m")
    assert src.url == url and src.sha256 == sha and src.path.name == "m_jacobian_lens.pt"
    assert L.load_lens(src.path).n_prompts == 3
    (root / "m_jacobian_lens.pt").unlink()                     # reuse needs no server
    again = LF.resolve({"url": url, "sha256": sha}, tmp_path / "cache", "probes.lens_files.m")
    assert again == src


def test_changed_cache_and_wrong_pin_are_errors(server, tmp_path):
    _, base = server
    url = f"{base}/m_jacobian_lens.pt"
    src = LF.resolve(url, tmp_path / "cache", "probes.lens_files.m")
    with pytest.raises(L.LensError, match="the params pin"):
        LF.resolve({"url": url, "sha256": "0" * 64}, tmp_path / "cache", "probes.lens_files.m")
    src.path.write_bytes(src.path.read_bytes()[:-5])
    with pytest.raises(L.LensError, match=r"probes.lens_files.m: cached lens .* delete .* to download it again"):
        LF.resolve(url, tmp_path / "cache", "probes.lens_files.m")


def test_missing_url_local_path_and_names(server, tmp_path):
    _, base = server
    with pytest.raises(L.LensError, match="downloading .* failed"):
        LF.resolve(f"{base}/absent.pt", tmp_path / "cache", "probes.lens_files.m")
    assert not list((tmp_path / "cache").rglob("*.part"))
    with pytest.raises(L.LensError, match="does not exist"):
        LF.resolve(str(tmp_path / "nope.pt"), tmp_path / "cache", "probes.lens_files.m")
    with pytest.raises(L.LensError, match="64-digit"):
        LF.resolve({"url": f"{base}/x.pt", "sha256": "abc"}, tmp_path / "cache", "probes.lens_files.m")
    assert LF.to_url("hf://neuronpedia/jacobian-lens/llama/lens.pt") == \
        "https://huggingface.co/neuronpedia/jacobian-lens/resolve/main/llama/lens.pt"
    assert LF.to_url("lenses/local.pt") is None


def test_caveat_depends_on_the_model():
    fitted = {"source": "fitted here", "n_prompts": 1, "corpus": {"name": "python-pydoc_data-topics"}}
    tiny = core.caveat(models.get_model("gemma-3-270m"), fitted, {1: "trained here"})
    assert "embedded tiny model (268M parameters)" in tiny and "pydoc" in tiny
    given = {"source": "given", "url": "https://x/lens.pt", "sha256": "ab" * 32}
    big = core.caveat(models.get_model("llama-3.1-8b-instruct"), given, {19: "given"})
    assert "tiny" not in big and "meta-llama/Llama-3.1-8B-Instruct" in big and "https://x/lens.pt" in big
    assert "given (released)" in big and "previous benchmark version" in big


def test_published_lenses_by_name_from_the_hub_layout(server, tmp_path, monkeypatch):
    root, base = server
    spec = models.get_model("gemma-2-9b-it")
    name = LF.published(spec, "probes.lens_files.gemma-2-9b-it")
    assert name == spec.jacobian_lens and name.startswith(models.JLENS + "/gemma-2-9b-it/")
    assert {s.name for s in models.REGISTRY.values() if s.jacobian_lens} == {
        "llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "gemma-2-9b-it"}          # Table 8's three models
    with pytest.raises(L.LensError, match="mistral-7b-instruct-v0.3 has no published Jacobian lens"):
        LF.published(models.get_model("mistral-7b-instruct-v0.3"), "probes.lens_files.mistral")
    # the Hub's file layout served locally (HF_ENDPOINT), at main and at a pinned revision
    path = name[len("hf://"):].split("/", 2)[2]
    for rev in ("main", "a4114d7"):
        f = root / "neuronpedia" / "jacobian-lens" / "resolve" / rev / path
        f.parent.mkdir(parents=True)
        f.write_bytes((root / "m_jacobian_lens.pt").read_bytes())
    monkeypatch.setenv("HF_ENDPOINT", base)
    src = LF.resolve(name, tmp_path / "cache", "probes.lens_files.gemma-2-9b-it")
    assert src.url == f"{base}/neuronpedia/jacobian-lens/resolve/main/{path}" and L.load_lens(src.path).n_prompts == 3
    pinned = LF.resolve(name.replace("jacobian-lens/", "jacobian-lens@a4114d7/", 1), tmp_path / "cache", "w")
    assert "/resolve/a4114d7/" in pinned.url and pinned.sha256 == src.sha256


def test_run_lens_reads_published_as_the_models_lens(monkeypatch, tmp_path):
    import dataclasses

    from test_probes import tiny_lm

    from memtoc.config.runconfig import RunConfig
    lm = tiny_lm()
    seen = []

    def fake_resolve(entry, cache_root, where):
        seen.append((entry, where))
        raise L.LensError("stop here")
    monkeypatch.setattr(LF, "resolve", fake_resolve)
    pr = RunConfig.of({"probes": {"lens_files": {lm.name: "published"}}}).probes
    with pytest.raises(L.LensError, match="has no published Jacobian lens"):
        core.run_lens(lm, pr, [], tmp_path, [], [], None, tmp_path)
    lm = dataclasses.replace(lm, spec=dataclasses.replace(lm.spec, jacobian_lens="hf://o/r/x_jacobian_lens.pt"))
    with pytest.raises(L.LensError, match="stop here"):
        core.run_lens(lm, pr, [], tmp_path, [], [], None, tmp_path)
    assert seen == [("hf://o/r/x_jacobian_lens.pt", f"probes.lens_files.{lm.name}")]
