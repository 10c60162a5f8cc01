"""Released-dictionary readers (notebook 05): tiny random weights written in each layout read back
with the encode/decode rules of sae-lens 6 (StandardSAE, JumpReLUSAE, TopKSAE)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from memtoc.stages.probes import dictionaries as D

D_IN, D_SAE = 6, 10


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(D_IN, D_SAE, generator=g), "b_enc": torch.randn(D_SAE, generator=g) * 0.1,
            "W_dec": torch.randn(D_SAE, D_IN, generator=g), "b_dec": torch.randn(D_IN, generator=g),
            "threshold": torch.rand(D_SAE, generator=g) * 0.5}


def _x():
    return torch.randn(7, D_IN, generator=torch.Generator().manual_seed(9))


def _sae_lens_dir(tmp_path, arch, w, **cfg):
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp_path / D.WEIGHTS_FILE))
    (tmp_path / D.CFG_FILE).write_text(json.dumps({"architecture": arch, "d_in": D_IN, "d_sae": D_SAE, **cfg}))
    return tmp_path


@pytest.mark.parametrize("centred", [True, False])
def test_sae_lens_layout_relu_jumprelu_topk(tmp_path, centred):
    w, x = _weights(), _x()
    sae_in = x - w["b_dec"] if centred else x
    pre = sae_in @ w["W_enc"] + w["b_enc"]
    want = {"standard": torch.relu(pre), "jumprelu": torch.relu(pre) * (pre > w["threshold"])}
    top = pre.topk(3, dim=-1)
    want["topk"] = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    for arch, f in want.items():
        d = tmp_path / arch
        d.mkdir()
        ww = w if arch == "jumprelu" else {k: v for k, v in w.items() if k != "threshold"}
        sae, cfg = D.load_sae(_sae_lens_dir(d, arch, ww, k=3, apply_b_dec_to_input=centred))
        assert cfg["layout"] == "sae-lens"
        assert torch.allclose(sae.encode(x), f, atol=1e-6), arch
        assert torch.allclose(sae(x), f @ w["W_dec"] + w["b_dec"], atol=1e-5), arch
    assert (want["jumprelu"] != want["standard"]).any()   # the threshold matters on these weights


def test_sae_lens_default_centres_and_topk_rescale(tmp_path):
    w, x = _weights(1), _x()
    w.pop("threshold")
    sae, _ = D.load_sae(_sae_lens_dir(tmp_path, "topk", w, k=2, rescale_acts_by_decoder_norm=True))
    n = w["W_dec"].norm(dim=-1)
    pre = ((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) * n
    top = pre.topk(2, dim=-1)
    want = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu()) / n
    assert torch.allclose(sae.encode(x), want, atol=1e-6)


def test_gemmascope_params_npz(tmp_path):
    w, x = _weights(2), _x()
    np.savez(tmp_path / D.GEMMASCOPE_FILE, **{k: v.numpy() for k, v in w.items()})
    for where in (tmp_path, tmp_path / D.GEMMASCOPE_FILE):
        sae, cfg = D.load_sae(where)
        assert cfg["layout"] == "gemmascope" and sae.architecture == "jumprelu" and not sae.apply_b_dec_to_input
        pre = x @ w["W_enc"] + w["b_enc"]                   # GemmaScope does not centre the input
        f = pre * (pre > w["threshold"])
        assert torch.allclose(sae.encode(x), f, atol=1e-6)
        assert torch.allclose(sae(x), f @ w["W_dec"] + w["b_dec"], atol=1e-5)


def test_llama_scope_layout_folds_the_norm_factor(tmp_path):
    w, x = _weights(3), _x()
    avg = 4.0
    (tmp_path / "checkpoints").mkdir()
    save_file({"encoder.weight": w["W_enc"].T.contiguous(), "encoder.bias": w["b_enc"],
               "decoder.weight": w["W_dec"].T.contiguous(), "decoder.bias": w["b_dec"]},
              str(tmp_path / D.LLAMASCOPE_WEIGHTS))
    (tmp_path / D.LLAMASCOPE_CFG).write_text(json.dumps({
        "d_model": D_IN, "d_sae": D_SAE, "jump_relu_threshold": 0.2, "hook_point_in": "blocks.3.hook_resid_post",
        "dataset_average_activation_norm": {"in": avg, "out": avg}}))
    sae, cfg = D.load_sae(tmp_path)
    s = D_IN ** 0.5 / avg
    assert cfg["layout"] == "llama-scope" and cfg["norm_scaling_factor"] == pytest.approx(s)
    pre = (x * s) @ w["W_enc"] + w["b_enc"]
    f = torch.relu(pre) * (pre > 0.2 * s)
    assert torch.allclose(sae.encode(x), f, atol=1e-5)
    assert torch.allclose(sae(x), (f @ w["W_dec"] + w["b_dec"]) / s, atol=1e-5)


def test_reader_errors_name_the_file_and_fix(tmp_path):
    with pytest.raises(D.SAEError, match="no dictionary found"):
        D.load_sae(tmp_path)
    w = _weights()
    d = _sae_lens_dir(tmp_path, "gated", w)
    with pytest.raises(D.SAEError, match="architecture 'gated'"):
        D.load_sae(d)
    _sae_lens_dir(tmp_path, "jumprelu", w, normalize_activations="expected_average_only_in")
    with pytest.raises(D.SAEError, match="fold the scaling first"):
        D.load_sae(tmp_path)
    _sae_lens_dir(tmp_path, "jumprelu", {k: v for k, v in w.items() if k != "threshold"})
    with pytest.raises(D.SAEError, match="no tensor threshold"):
        D.load_sae(tmp_path)
    _sae_lens_dir(tmp_path, "standard", w | {"W_enc": torch.zeros(D_IN + 1, D_SAE)})
    with pytest.raises(D.SAEError, match="W_enc has shape"):
        D.load_sae(tmp_path)


def test_trained_topk_file_still_reads_as_before(tmp_path):
    from memtoc.stages.probes import sae as S
    sae = S.TopKSAE(D_IN, D_SAE, 3)
    with torch.no_grad():
        for name, t in _weights(4).items():
            if hasattr(sae, name):
                getattr(sae, name).copy_(t)
    S.save_sae(sae, tmp_path, model_name="m", layer=1)
    again, cfg = D.load_sae(tmp_path)
    assert again.architecture == "topk" and again.apply_b_dec_to_input and sorted(again.state_dict()) == sorted(sae.state_dict())
    assert torch.equal(again.encode(_x()), sae.encode(_x()))
