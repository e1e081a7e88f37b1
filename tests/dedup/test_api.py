"""Public surface of ``dedup``: exported names, config validation, import isolation."""

from __future__ import annotations

import re

import os
import subprocess
import sys
from pathlib import Path

import pytest

from promptsplice import dedup
from promptsplice.dedup import DedupConfig
from promptsplice.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_public_names_are_pinned():
    assert dedup.__all__ == [
        "ACCELERATED",
        "DedupConfig",
        "DedupResult",
        "DedupStats",
        "DroppedChunk",
        "InputChunk",
        "KeptChunk",
        "Origin",
        "Relation",
        "RemovedPassage",
        "dedup",
        "normalize_chunks",
    ]
    assert isinstance(dedup.ACCELERATED, bool)  # a constant: no __module__
    for name in dedup.__all__[1:]:
        assert getattr(dedup, name).__module__.startswith("promptsplice.dedup.")
    assert [r.value for r in dedup.Relation] == [
        "kept", "duplicate", "contained", "merged", "passages",
    ]  # fmt: skip


def test_defaults():
    cfg = DedupConfig()
    assert (cfg.exact, cfg.containment, cfg.overlap, cfg.passages) == (True, True, True, True)
    assert (cfg.min_overlap, cfg.min_passage, cfg.source_key, cfg.start_key, cfg.on_invalid_utf8) == (
        64, 128, "source", "start_index", "error",
    )  # fmt: skip
    with pytest.raises(AttributeError):
        cfg.exact = False  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_overlap": 0}, "DedupConfig.min_overlap must be an int in [1, sys.maxsize]"),
        ({"min_overlap": 1.5}, "DedupConfig.min_overlap must be an int in [1, sys.maxsize]"),
        ({"min_passage": -3}, "DedupConfig.min_passage must be an int in [1, sys.maxsize]"),
        ({"min_passage": True}, "DedupConfig.min_passage must be an int in [1, sys.maxsize]"),
        # the C core takes a Py_ssize_t: above it a raw OverflowError (the Python passes ran)
        ({"min_overlap": 2**63}, "DedupConfig.min_overlap must be an int in [1, sys.maxsize]"),
        ({"min_passage": 2**63}, "DedupConfig.min_passage must be an int in [1, sys.maxsize]"),
        ({"on_invalid_utf8": "ignore"}, "must be 'error' or 'replace', got 'ignore'"),
        ({"exact": "yes"}, "DedupConfig.exact must be True or False, got 'yes'"),
        ({"source_key": ""}, "DedupConfig.source_key must be a non-empty str"),
        ({"start_key": ""}, "DedupConfig.start_key must be a non-empty str or None"),
        ({"start_key": 0}, "DedupConfig.start_key must be a non-empty str or None"),
        ({"order": "canonical"}, "DedupConfig.order must be 'retrieval', 'content' or None"),
    ],
)
def test_bad_config_values_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        DedupConfig(**kwargs)
    with pytest.raises(ConfigError):  # the same through overrides
        dedup.dedup(["text"], **kwargs)


def test_unknown_override_lists_the_valid_options():
    with pytest.raises(ConfigError) as err:
        dedup.dedup(["text"], min_overlapp=10)
    assert str(err.value) == (
        "unknown dedup option(s) 'min_overlapp'; valid options: exact, containment, overlap, "
        "passages, min_overlap, min_passage, source_key, start_key, on_invalid_utf8, order"
    )


def test_config_of_the_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="config must be a DedupConfig or None, got dict"):
        dedup.dedup(["text"], {"exact": False})  # type: ignore[arg-type]


def test_normalize_policy_is_validated():
    with pytest.raises(ConfigError, match="on_invalid_utf8 must be 'error' or 'replace'"):
        dedup.normalize_chunks(["x"], on_invalid_utf8="strict")


def test_import_pulls_in_no_heavy_or_optional_dependency():
    code = (
        "import sys\n"
        "from promptsplice.dedup import dedup\n"
        "dedup(['a', 'a', 'b'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('langchain_core', 'langchain', 'torch', 'numpy') or m.split('.')[:2] in "
        "(['promptsplice', r] for r in ('assembler', 'engine_adapters', 'kernels', 'benchmarks')))\n"
        "print('BAD', bad)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True
    )
    assert out.stdout.strip() == "BAD []"
