"""Start-up of the embedded engine and its first requests, as a new user meets them.

Run:  ``python -m promptsplice.benchmarks.startup`` (prints one JSON line): seconds to
import the engine adapters, to start ``EmbeddedEngine()`` with the defaults (the model
already prepared by ``promptsplice model prepare``), and the first and a repeated
300-token request (4 tokens generated), with vLLM's cached-token count of the repeat.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(  # no options: --help says what it runs, and starts nothing
        prog="python -m promptsplice.benchmarks.startup", description=__doc__.splitlines()[0]
    ).parse_args(argv)
    t0 = time.perf_counter()
    from promptsplice.engine_adapters import EmbeddedEngine

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    engine = EmbeddedEngine()
    t_start = time.perf_counter() - t1
    try:
        ids = list(range(1000, 1300))
        t2 = time.perf_counter()
        first = engine.generate(ids, max_tokens=4)
        t_first = time.perf_counter() - t2
        t3 = time.perf_counter()
        again = engine.generate(ids, max_tokens=4)
        t_again = time.perf_counter() - t3
        print(json.dumps({
            "dtype": engine.config.dtype,
            "import_s": round(t_import, 2),
            "start_s": round(t_start, 2),
            "first_request_s": round(t_first, 3),
            "first_ttft_s": round(first.ttft_s, 3),
            "repeat_request_s": round(t_again, 3),
            "repeat_cached_tokens": again.num_cached_tokens,
        }))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
