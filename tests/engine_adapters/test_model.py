"""The default model's weights, converted from the packaged GGUF on the engine side."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(600)
def test_conversion_writes_a_complete_bf16_folder_with_our_tokenizer(tmp_path):
    from promptsplice.assets import ensure_default_tokenizer, is_complete
    from promptsplice.engine_adapters._model import ensure_default_model

    folder = ensure_default_model(tmp_path / "model")
    assert is_complete(folder) and (folder / "model.safetensors").stat().st_size > 200_000_000
    cfg = json.loads((folder / "config.json").read_text())
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    assert theta == 100000.0 and cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    assert "quantization_config" not in cfg
    ours = json.loads((ensure_default_tokenizer() / "tokenizer.json").read_text())
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["merges"] == ours["model"]["merges"]
    assert ensure_default_model(folder) == folder  # complete: reused, not converted again
