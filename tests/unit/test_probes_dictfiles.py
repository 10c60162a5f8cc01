"""Released dictionaries by address (probes.sae_files): the hub's folder layout served on 127.0.0.1,
each layout found and read, downloaded once with the files' sha256 recorded and checked on reuse."""
from __future__ import annotations

import functools
import http.server
import json
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from memtoc.stages.probes import dictfiles as DF, dictionaries as D


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "www"
    g = torch.Generator().manual_seed(0)
    w = {"W_enc": torch.randn(6, 10, generator=g), "b_enc": torch.randn(10, generator=g),
         "threshold": torch.rand(10, generator=g), "W_dec": torch.randn(10, 6, generator=g),
         "b_dec": torch.randn(6, generator=g)}
    gs = root / "google" / "gemma-scope-tiny" / "resolve" / "main" / "layer_3" / "width_16k" / "average_l0_7"
    gs.mkdir(parents=True)
    np.savez(gs / D.GEMMASCOPE_FILE, **{k: v.numpy() for k, v in w.items()})
    sl = root / "someone" / "sae-tiny" / "resolve" / "v1" / "blocks.3"
    sl.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in w.items() if k != "threshold"}, str(sl / D.WEIGHTS_FILE))
    (sl / D.CFG_FILE).write_text(json.dumps({"architecture": "standard", "d_in": 6, "d_sae": 10}))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
    yield root, w, gs, sl
    srv.shutdown()


def test_gemmascope_folder_by_hub_name_downloaded_once(hub, tmp_path):
    root, w, gs, _ = hub
    name = "hf://google/gemma-scope-tiny/layer_3/width_16k/average_l0_7"
    folder, rec = DF.resolve(name, tmp_path / "cache", "probes.sae_files.m.3")
    assert rec["layout"] == "gemmascope" and list(rec["files"]) == [D.GEMMASCOPE_FILE]
    sae, cfg = D.load_sae(folder)
    assert cfg["layout"] == "gemmascope" and torch.allclose(sae.W_dec, w["W_dec"])
    (gs / D.GEMMASCOPE_FILE).unlink()                       # a reuse needs no server
    again, rec2 = DF.resolve(name, tmp_path / "cache", "probes.sae_files.m.3")
    assert again == folder and rec2["files"] == rec["files"]
    (folder / D.GEMMASCOPE_FILE).write_bytes(b"truncated")
    with pytest.raises(D.SAEError, match=r"probes.sae_files.m.3: cached .* delete .* to download it again"):
        DF.resolve(name, tmp_path / "cache", "probes.sae_files.m.3")


def test_sae_lens_folder_at_a_revision_and_the_errors(hub, tmp_path):
    _, w, _, sl = hub
    folder, rec = DF.resolve("hf://someone/sae-tiny@v1/blocks.3", tmp_path / "cache", "w")
    assert rec["layout"] == "sae-lens" and set(rec["files"]) == {D.CFG_FILE, D.WEIGHTS_FILE}
    assert D.load_sae(folder)[1]["layout"] == "sae-lens"
    assert not list((tmp_path / "cache").rglob(D.GEMMASCOPE_FILE))     # the layout tried first left nothing
    with pytest.raises(D.SAEError, match=r"serves no dictionary layout .* gemmascope \(params.npz: HTTP 404\)"):
        DF.resolve("hf://someone/sae-tiny@v1/blocks.9", tmp_path / "cache", "w")
    local, lrec = DF.resolve(str(sl), tmp_path / "cache", "w")
    assert local == sl and lrec["url"] is None and set(lrec["files"]) == {D.CFG_FILE, D.WEIGHTS_FILE}
    with pytest.raises(D.SAEError, match="does not exist"):
        DF.resolve(str(tmp_path / "absent"), tmp_path / "cache", "w")
