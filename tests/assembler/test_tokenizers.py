"""Tokenizer adapters on the real default tokenizer and real tiktoken encodings."""

from __future__ import annotations

import pytest

from promptsplice.assembler import HFTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
from promptsplice.errors import TokenizerError


def test_default_tokenizer_is_smollm2(default_tok):
    assert default_tok.name == "hf:SmolLM2-135M-Instruct"
    assert default_tok.vocab_size == 49152
    assert isinstance(default_tok, Tokenizer)
    # no special tokens are added: assembly concatenates segments in token space
    assert default_tok.encode("Hello world.") == [19556, 905, 30]
    assert default_tok.decode([19556, 905, 30]) == "Hello world."
    assert default_tok.decode([default_tok.filler_token_id]) == " "
    assert default_tok.encode_batch(["Hello world.", "\n\nThe cat"]) == [[19556, 905, 30], [198, 198, 504, 2644]]
    assert load_tokenizer("default") is default_tok and load_tokenizer(None) is default_tok


@pytest.mark.parametrize(
    ("encoding", "text", "ids"),
    [("cl100k_base", "hello world", [15339, 1917]), ("o200k_base", "hello world", [24912, 2375])],
)
def test_tiktoken_offline_from_packaged_files(encoding, text, ids):
    tok = load_tokenizer(f"tiktoken:{encoding}")
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.name == f"tiktoken:{encoding}"
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.filler_token_id]).isspace()
    # special-token text is treated as plain text, never as a control token
    assert tok.encode("<|endoftext|>") != [100257]


def test_hf_tokenizer_from_path(default_tok, tmp_path):
    from promptsplice.assets import default_model_dir

    tok = load_tokenizer(str(default_model_dir() / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("Paris is the capital of France.") == default_tok.encode(
        "Paris is the capital of France."
    )


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        load_tokenizer("no-such-tokenizer")
    with pytest.raises(TokenizerError, match="Tokenizer protocol"):
        load_tokenizer(object())  # type: ignore[arg-type]
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="not a Hugging Face fast tokenizer"):
        HFTokenizer(object(), name="x")


@pytest.mark.parametrize("encoding", ["cl100k_base", "o200k_base"])
def test_openai_caching_rules_with_real_tiktoken_files(encoding):
    from promptsplice.assembler import Assembler
    from promptsplice.benchmarks.traces import load_wiki_leads

    asm = Assembler.for_openai(encoding, alignment="none")
    assert asm.block_size == 128 and asm.tokenizer.name == f"tiktoken:{encoding}"
    leads = [t for _, t in load_wiki_leads()[:80]]
    short = [{"id": "s", "text": leads[0]}]
    first = asm.assemble(short, query="q?", system="You answer questions.")
    again = asm.assemble(short, query="q?", system="You answer questions.")
    assert first.num_tokens < 1024 and again.predicted_cached_tokens == 0  # below the minimum
    docs = [{"id": f"d{i}", "text": t} for i, t in enumerate(leads[1:40])]
    long1 = asm.assemble(docs, query="q?", system="You answer questions.")
    long2 = asm.assemble(docs, query="another question?", system="You answer questions.")
    assert long1.num_tokens > 2048
    cached = long2.predicted_cached_tokens
    assert cached >= 1024 and cached % 128 == 0 and cached > long2.num_tokens - 2 * 128
    # OpenAI tokenizes the text itself: tiktoken's pre-tokenizer merges punctuation with
    # the "\n\n" separator (".\n\n" is one token), so the text form is the same string
    # but not the same ids at segment boundaries; the prefix is still byte-stable.
    assert asm.tokenizer.decode(long2.token_ids) == long2.text
    assert long2.text.startswith(long1.text[: long1.text.index("Question:")])


def test_assembling_with_the_default_tokenizer_never_imports_torch():
    """The default tokenizer comes from the GGUF's metadata: a process that only
    assembles never loads torch, transformers or vLLM."""
    import subprocess
    import sys

    code = (
        "import sys, promptsplice\n"
        "p = promptsplice.assemble_prompt(['Paris is in France.', 'Rome is in Italy.'], query='Where?')\n"
        "assert p.num_tokens > 10 and p.segments\n"
        "from promptsplice.assembler import ChatRenderer\n"
        "r = ChatRenderer().render([{'role': 'user', 'content': 'hi'}])\n"
        "assert r.num_tokens > 5\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
