"""The default model's weights: the packaged GGUF converted once to a Hugging Face folder.

Engine side, because the conversion needs torch and transformers (imported only when it
runs): transformers' GGUF loader dequantizes the Q4_1 weights and they are saved as
bf16 safetensors with config, tokenizer and chat template, in
:func:`promptsplice.assets.default_model_dir` (see :mod:`promptsplice.assets` for the
cache locations and the tokenizer, which needs none of this).
"""

from __future__ import annotations

import json
from pathlib import Path

from promptsplice.assets import build_folder, default_model_dir, gguf_path, model_ready, weights_stamp
from promptsplice.errors import AssetError

__all__ = ["ensure_default_model"]

# SmolLM2-135M's published config: rope_theta 100000 (the GGUF metadata is not always
# read back by transformers' loader, and a wrong theta silently breaks RoPE relocation).
_ROPE_THETA = 100000.0


def ensure_default_model(folder: Path | None = None) -> Path:
    """Return the converted default model folder, converting it first if needed (~20 s)."""
    folder = default_model_dir() if folder is None else Path(folder)
    if model_ready(folder):  # built here by this converter, or the user's own conversion
        return folder
    source = gguf_path()
    return build_folder(folder, source, _convert, weights_stamp(source))


def _convert(source: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise AssetError(
            "converting the default model needs torch, transformers and gguf: pip install "
            "'promptsplice[cpu]' (or [gpu]; in a checkout: `make setup`)"
        ) from exc
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.bfloat16
    )
    model.config.rope_theta = _ROPE_THETA
    if getattr(model.config, "rope_parameters", None) is not None:
        model.config.rope_parameters["rope_theta"] = _ROPE_THETA
    model.config.torch_dtype = "bfloat16"
    # The weights are dequantized on load; drop the GGUF quantizer so they save as bf16.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    # An explicit class name, so vLLM/transformers never guess from the GGUF metadata.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "GPT2TokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
