"""Helpers for tests that compare with Hugging Face transformers (torch CPU)."""
from __future__ import annotations

import pytest


def make_hf_model(tmp_path, **config_kw):
    """Random Qwen3ForCausalLM saved with save_pretrained; returns (model, directory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(config_kw.pop("seed", 0))
    cfg = transformers.Qwen3Config(**config_kw)
    model = transformers.Qwen3ForCausalLM(cfg).eval().to(torch.float32)
    # Norm weights start at 1: perturb them so a wrong mapping would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "hf"
    model.save_pretrained(path, safe_serialization=True)
    return model, path
