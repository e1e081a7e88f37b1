#!/usr/bin/env bash
# The GPU check as one command, on a bare CUDA machine (PyTorch and Triton, no vLLM, no
# network, this tree not installed): installs the tree without dependencies into a
# scratch folder, then runs the connector check and the kernel check, each result in one
# JSON under $OUT (default out/gpu).  Exit status: the connector check's (0 correct,
# 1 a correctness check failed, 2 nothing run), or 3 when the tree did not install.
#
#   scripts/gpu_check.sh                         # on the GPU machine, ~8 min at most
#   PYTHON=.venv/bin/python scripts/gpu_check.sh --device cpu --quick   # CPU dry run
#
# Arguments go to gpu_connector_check (--device, --quick, --impl, --reps, --seed).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
[[ $PYTHON == */* ]] && PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"  # (cd below)
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
SITE=$(mktemp -d "${TMPDIR:-/tmp}/promptsplice-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT

[[ -e "$ROOT/build" ]] && had_build=1 || had_build=0
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target "$SITE/lib" "$ROOT" >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
(( had_build )) || rm -rf "$ROOT/build"  # setuptools' staging folder, left in the tree
export PYTHONPATH="$SITE/lib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$SITE"  # not the tree's root, whose promptsplice/ folder would shadow the install

"$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
"$PYTHON" -m promptsplice.benchmarks.gpu_connector_check --json "$OUT/gpu_connector_check.json" "$@"
status=$?
quick=()
for a in "$@"; do [[ $a == --quick ]] && quick=(--quick); done
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PYTHON" -m promptsplice.benchmarks.gpu_splice_check --json "$OUT/gpu_splice_check.json" "${quick[@]}" \
        || echo "gpu_splice_check failed (exit $?)"
fi
exit $status
