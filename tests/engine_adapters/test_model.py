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


def test_an_engine_tokenizer_knows_the_folder_its_chat_template_is_in(tmp_path, monkeypatch):
    """A chat renderer over an engine's tokenizer takes the model's template from the
    folder the tokenizer came from (``HFTokenizer.model_dir``): a model folder, or for a
    hub id the snapshot in Hugging Face's cache; a hub id with nothing cached has none
    (a render then asks for ``template=``, never the default model's)."""
    import huggingface_hub.constants

    from promptsplice.engine_adapters._lifecycle import _model_dir

    folder = tmp_path / "my-model"
    folder.mkdir()
    assert _model_dir(str(folder)) == folder
    repo = tmp_path / "hub" / "models--org--chat-model"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snap / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert _model_dir("org/chat-model") == snap
    assert _model_dir("org/not-downloaded") is None
    assert _model_dir("not a hub id at all!") is None  # refused by the hub client: no folder, no failure


def test_a_model_of_the_users_own_named_by_the_env_gets_its_own_tokenizer(tmp_path, monkeypatch):
    """``PROMPTSPLICE_MODEL_DIR`` naming a model of the user's own (no marker) made it
    "the default model": its prompts were tokenized with SmolLM2's tokenizer while vLLM
    ran it with its own.  Only the folder promptsplice converted is the default."""
    import shutil

    from promptsplice.assembler import default_tokenizer
    from promptsplice.assets import ensure_default_tokenizer
    from promptsplice.engine_adapters._lifecycle import load_tokenizer

    folder = tmp_path / "my-model"
    folder.mkdir()
    shutil.copy(ensure_default_tokenizer() / "tokenizer.json", folder / "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv("PROMPTSPLICE_MODEL_DIR", str(folder))

    def no_llm():
        raise AssertionError("the folder's own tokenizer.json is read, vLLM's is not asked for")

    tok = load_tokenizer(str(folder), no_llm)
    assert tok is not default_tokenizer() and tok.name == f"hf:{(folder / 'tokenizer.json').resolve()}"
    assert tok.model_dir == folder.absolute()  # and its chat template from there
    (folder / ".complete").write_text("{}")  # converted by promptsplice: the default tokenizer
    assert load_tokenizer(str(folder), no_llm) is default_tokenizer()
