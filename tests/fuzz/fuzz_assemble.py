"""Atheris harness: prompt assembly under a context limit (issue #8).

Fuzzed chunks (every form, shared pieces, bad values), query, system prompt and tools
(lone surrogates included), policy, alignment, block size and ``max_tokens``, on the
real default tokenizer, with one assembler per block size kept across inputs (so the
mirror hits, ``auto`` pads and ``cache_aware`` reorders).  Crashes when an undocumented
exception escapes, a documented one is not the one the input calls for, or a prompt
exceeds the context it was given (``tests/fuzz/_checks.py: run_assembly``).

    python tests/fuzz/fuzz_assemble.py -max_total_time=60   # any libFuzzer flags
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["promptsplice.assembler", "promptsplice.dedup"]):
    from promptsplice import assembler  # noqa: F401  (instrumented, so its coverage guides the fuzzer)

from promptsplice.assembler import Assembler, default_tokenizer  # noqa: E402
from tests.fuzz import _fdp  # noqa: E402
from tests.fuzz._checks import run_assembly  # noqa: E402

TOKENIZER = default_tokenizer()
ASSEMBLERS = {bs: Assembler(TOKENIZER, block_size=bs, capacity_blocks=4096) for bs in (1, 4, 16, 32)}


def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    asm = ASSEMBLERS[fdp.PickValueInList(list(ASSEMBLERS))]
    kwargs = {
        "query": _fdp.text(fdp, 20),
        "system": _fdp.text(fdp, 20) if fdp.ConsumeBool() else None,
        "tools": [{_fdp.text(fdp, 4): _fdp.json_value(fdp)}] if fdp.ConsumeIntInRange(0, 3) == 0 else None,
        "policy": fdp.PickValueInList(["retrieval", "stable", "cache_aware"]),
        "alignment": fdp.PickValueInList(["none", "all", "auto"]),
    }
    limit = fdp.ConsumeIntInRange(1, 300)
    run_assembly(asm, _fdp.chunks(fdp), kwargs, limit)


if __name__ == "__main__":
    _fdp.fuzz(TestOneInput)
