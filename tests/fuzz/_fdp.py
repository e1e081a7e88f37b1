"""Builders of fuzz inputs from an atheris ``FuzzedDataProvider``, shared by the
harnesses (the hypothesis tests draw the same shapes with strategies)."""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.fuzz._checks import NOT_CHUNKS, DuckDocument

SEPARATORS = ["\n\n", ".", " ", "\n", "", ". "]
ODD_STRINGS = ["\ud800", "a\udfffb", "\ud83d\ude00", "\x00", "\u2028", "é", "東京", "\ufeff", "[" * 3000]


def text(fdp: Any, max_len: int = 12) -> str:
    """Any unicode (atheris may draw lone surrogates), sometimes an odd string."""
    if fdp.ConsumeIntInRange(0, 7) == 0:
        return fdp.PickValueInList(ODD_STRINGS)
    return fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, max_len))


def joined(fdp: Any, pool: list[str]) -> str:
    """Pieces of ``pool`` and separators: texts that share bytes and paragraphs."""
    return "".join(fdp.PickValueInList(pool) + fdp.PickValueInList(SEPARATORS) for _ in range(fdp.ConsumeIntInRange(0, 5)))


def json_value(fdp: Any, depth: int = 0) -> Any:
    """An arbitrary JSON-like value (NaN, inf, huge ints and lone surrogates included)."""
    kind = fdp.ConsumeIntInRange(0, 7 if depth < 3 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 16))
    if kind == 3:
        return fdp.ConsumeFloat()
    if kind == 4:
        return text(fdp)
    if kind == 5:
        return [json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if kind == 6:
        return {text(fdp, 4): json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}
    return json.loads("[" * 50 + "]" * 50)


def chunk_id(fdp: Any) -> Any:
    """None (a content-derived id), a str or int id, or one dedup must refuse."""
    if fdp.ConsumeBool():
        return fdp.PickValueInList([None, None, "a", "b", 1, "1", "", True, 2.5, ["x"], "c:0"])
    return text(fdp, 3) or None


METADATA = [None, {}, {"source": "doc"}, {"source": "other", "id": "m"}, {"source": ["x"]}, [], "source"]


def metadata(fdp: Any) -> Any:
    """Metadata: none, with or without a source (overlap merges need one), or not a dict."""
    return METADATA[fdp.ConsumeIntInRange(0, len(METADATA) - 1)]


def chunks(fdp: Any) -> list:
    """A retrieval result: chunks in every accepted form cut from a few shared pieces
    (repeats, windows of one document, paragraphs), raw bytes, and bad values."""
    pool = [text(fdp) for _ in range(fdp.ConsumeIntInRange(1, 4))]
    doc = joined(fdp, pool)
    out: list = []
    for _ in range(fdp.ConsumeIntInRange(0, 8)):
        kind = fdp.ConsumeIntInRange(0, 9)
        t = joined(fdp, pool)
        if kind == 0:
            out.append(t)
        elif kind == 1:
            out.append(t.encode("utf-8", "surrogatepass"))
        elif kind == 2:
            out.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16)))
        elif kind == 3:
            out.append({"text": t, "id": chunk_id(fdp), "metadata": metadata(fdp)})
        elif kind == 4:
            out.append(DuckDocument(t, metadata(fdp), chunk_id(fdp)))
        elif kind in (5, 6):  # a window of the document, same source: overlap merges
            a = fdp.ConsumeIntInRange(0, len(doc))
            b = fdp.ConsumeIntInRange(a, len(doc))
            out.append({"text": doc[a:b], "metadata": {"source": "doc", "rank": len(out)}})
        elif kind == 7 and out:
            out.append(fdp.PickValueInList(out))
        elif kind == 8:
            out.append(fdp.PickValueInList(NOT_CHUNKS))
        else:
            out.append(bytearray(t.encode("utf-8", "surrogatepass")))
    return out


def fuzz(test_one_input: Any, max_len: int = 1024) -> None:
    """Run libFuzzer on ``test_one_input`` with the command line's flags; inputs of up
    to ``max_len`` bytes from the start (libFuzzer's default grows them slowly, and a
    short run would only see chunks of a few bytes) unless ``-max_len`` is given."""
    import atheris

    argv = list(sys.argv)
    if not any(a.startswith("-max_len=") for a in argv):
        argv += [f"-max_len={max_len}", "-len_control=0"]
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
