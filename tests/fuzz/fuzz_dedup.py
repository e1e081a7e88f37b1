"""Atheris harness: dedup on arbitrary chunks (issue #8).

Chunks in every accepted form, cut from a few fuzzed pieces of unicode (so duplicates,
containment, overlaps and repeated paragraphs occur), raw bytes, odd ids and metadata,
and values that are not chunks, under both ``on_invalid_utf8`` policies and random
pass switches and thresholds.  Crashes when an undocumented exception escapes, the
documented one names the wrong chunk, or a result loses an input id
(``tests/fuzz/_checks.py: run_dedup``).

    python tests/fuzz/fuzz_dedup.py -max_total_time=60   # any libFuzzer flags
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["promptsplice"]):
    from promptsplice import dedup  # noqa: F401  (instrumented, so its coverage guides the fuzzer)

from tests.fuzz import _fdp  # noqa: E402
from tests.fuzz._checks import run_dedup  # noqa: E402

PASSES = ("exact", "containment", "overlap", "passages")


def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    policy = "replace" if fdp.ConsumeBool() else "error"
    options = {name: fdp.ConsumeIntInRange(0, 3) > 0 for name in PASSES}
    options["min_overlap"] = fdp.ConsumeIntInRange(1, 16)
    options["min_passage"] = fdp.ConsumeIntInRange(1, 32)
    run_dedup(_fdp.chunks(fdp), policy, **options)


if __name__ == "__main__":
    _fdp.fuzz(TestOneInput)
