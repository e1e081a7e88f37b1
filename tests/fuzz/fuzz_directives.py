"""Atheris harness: edit directives (issue #8).

Two renders over fuzzed token ids cut into fuzzed segments (token-less ones included),
the new one partly built from the old one's segments: ``apply(diff(a, b), a) == b`` and
the directives' promises (``tests/fuzz/_checks.py: check_diff``).  Then
``apply_directives`` on fuzzed, mostly malformed directives: the documented output or
DirectiveError with the documented problem and index (``check_apply_directives``).

    python tests/fuzz/fuzz_directives.py -max_total_time=60   # any libFuzzer flags
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["promptsplice.assembler"]):
    from promptsplice import assembler  # noqa: F401  (instrumented, so its coverage guides the fuzzer)

from promptsplice.assembler import Directive  # noqa: E402
from tests.fuzz import _fdp  # noqa: E402
from tests.fuzz._checks import check_apply_directives, check_diff, synthetic_render  # noqa: E402

GENERATIONS = [(), (1, 2, 3), (9,)]
BOUNDS = [None, True, False, 1.0, "1", -1]


def segments(fdp: atheris.FuzzedDataProvider, reuse: list) -> list:
    out = []
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        if reuse and fdp.ConsumeIntInRange(0, 2) > 0:  # shared segments: equal stretches
            seg = fdp.PickValueInList(reuse)
            if fdp.ConsumeBool():  # edited a little: grown, cut or one token changed
                seg = seg + fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 2), 0, 4) if fdp.ConsumeBool() else seg[1:]
            out.append(seg)
        else:
            out.append(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 5), 0, 4))
    return out


def bound(fdp: atheris.FuzzedDataProvider):
    return fdp.ConsumeIntInRange(-1, 9) if fdp.ConsumeIntInRange(0, 5) else fdp.PickValueInList(BOUNDS)


def directive(fdp: atheris.FuzzedDataProvider):
    kind = fdp.ConsumeIntInRange(0, 5)
    rep = fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 3), 0, 9)
    if kind == 0:
        return Directive(bound(fdp), bound(fdp), tuple(rep))
    if kind == 1:
        return ((bound(fdp), bound(fdp)), fdp.PickValueInList([None, 5, tuple(rep), "78", {"k": 1}, [1.5], [-1], (True,)]))
    if kind == 2:
        return fdp.PickValueInList(["nonsense", None, 3, (), (1, 2, 3), ((1,), []), ((1, 2, 3), [])])
    return ((bound(fdp), bound(fdp)), rep)


def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    old = segments(fdp, [])
    new = segments(fdp, old)
    check_diff(
        synthetic_render(old, fdp.PickValueInList(GENERATIONS)),
        synthetic_render(new, fdp.PickValueInList(GENERATIONS)),
    )
    tokens = fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 8), 0, 9)
    check_apply_directives(tokens, [directive(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))])


if __name__ == "__main__":
    _fdp.fuzz(TestOneInput)
