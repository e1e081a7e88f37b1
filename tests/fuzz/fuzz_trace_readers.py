"""Atheris harness: the RAG and agent trace readers (issue #8).

Each input becomes a trace file: raw fuzzed bytes, a line of fuzzed JSON, or a line of
the documented RAG or agent format with one structural edit (a value replaced by fuzzed
JSON, a key or item deleted or added, a value wrapped in a list) and a few byte edits.
Both readers read it; crashes when anything but TraceFormatError escapes, or when what
a reader accepted does not survive being written back and read again
(``tests/fuzz/_checks.py: check_trace_bytes``).

    python tests/fuzz/fuzz_trace_readers.py -max_total_time=60   # any libFuzzer flags
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["promptsplice.benchmarks"]):
    import promptsplice.benchmarks.agent_traces  # noqa: F401  (instrumented, so their coverage
    import promptsplice.benchmarks.traces  # noqa: F401  guides the fuzzer)

from tests.fuzz import _fdp  # noqa: E402
from tests.fuzz._checks import VALID_AGENT_LINE, VALID_RAG_LINE, check_trace_bytes, mutate_bytes, mutate_json  # noqa: E402

PATH = Path(tempfile.mkdtemp(prefix="promptsplice-fuzz-traces-")) / "trace.jsonl"
TOKENS = [b'"', b"{", b"}", b"[", b"]", b",", b":", b"\\", b"\\ud800", b"1e400", b"NaN", b"\n", b"\xef\xbb\xbf", b"\xff",
          b"[" * 2000, b'{"a":' * 1200]  # nesting deeper than the parser's recursion limit


def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 3)
    ascii = fdp.ConsumeBool()
    if mode == 0:
        line = fdp.ConsumeBytes(fdp.remaining_bytes())
    elif mode == 1:
        line = json.dumps(_fdp.json_value(fdp), ensure_ascii=ascii).encode("utf-8", "surrogatepass")
    else:
        template = VALID_RAG_LINE if mode == 2 else VALID_AGENT_LINE
        obj = mutate_json(template, fdp.ConsumeIntInRange(0, 63), fdp.ConsumeIntInRange(0, 3), _fdp.json_value(fdp))
        edits = []
        for _ in range(fdp.ConsumeIntInRange(0, 2)):
            insert = fdp.PickValueInList(TOKENS) if fdp.ConsumeBool() else fdp.ConsumeBytes(2)
            edits.append((fdp.ConsumeIntInRange(0, 2048), fdp.ConsumeIntInRange(0, 3), insert))
        line = mutate_bytes(json.dumps(obj, ensure_ascii=ascii).encode("utf-8", "surrogatepass"), edits)
        if fdp.ConsumeBool():  # after a valid line of another id
            line = json.dumps({**template, "id": "other"}).encode() + b"\n" + line
    check_trace_bytes(line, PATH)


if __name__ == "__main__":
    _fdp.fuzz(TestOneInput)
