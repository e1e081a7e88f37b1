#!/usr/bin/env bash
# The GPU check as one command, on a bare CUDA machine (PyTorch and Triton, no vLLM, no
# network, this tree not installed): installs the tree without dependencies into a
# scratch folder, then runs the connector check and the kernel check, each result in one
# JSON and one log under $OUT (default out/gpu), each check bounded by CHECK_TIMEOUT
# seconds (default 300).  Exit status, over both checks: 1 when either failed (a
# correctness check, a crash or a timeout), else 2 when either ran nothing (on CUDA the
# kernel check must run), else 0; 3 when the tree did not install.  On CUDA the
# connector check runs the Triton kernel (--impl triton) unless --impl is given.
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
TIMEOUT=${CHECK_TIMEOUT:-300}
quick=() impl=() device=cuda prev=
for a in "$@"; do
    [[ $a == --quick ]] && quick=(--quick)
    [[ $a == --impl || $a == --impl=* ]] && impl=(given)
    [[ $prev == --device ]] && device=$a
    [[ $a == --device=* ]] && device=${a#--device=}
    prev=$a
done
cuda=0
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' && cuda=1
# on CUDA, "auto" without a working Triton ran torch and passed without the kernel
(( cuda )) && [[ $device == cuda* && ${#impl[@]} -eq 0 ]] && set -- --impl triton "$@"

run() {  # run NAME ARGS...: the check's output to the terminal and $OUT/NAME.log; its exit status
    local name=$1; shift
    timeout "$TIMEOUT" "$PYTHON" -m "promptsplice.benchmarks.$name" --json "$OUT/$name.json" "$@" 2>&1 \
        | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    (( rc == 124 )) && echo "$name: timed out after $TIMEOUT s" | tee -a "$OUT/$name.log"
    (( rc == 0 || rc == 2 )) || rc=1  # a crash (1) or a timeout (124): failed
    echo "$name: exit $rc" | tee -a "$OUT/$name.log"
    return "$rc"
}

run gpu_connector_check "$@"; connector=$?
splice=0
if (( cuda )); then
    run gpu_splice_check "${quick[@]}"; splice=$?
    (( splice == 2 )) && splice=1  # on CUDA the kernel check must run
fi
if (( connector == 1 || splice == 1 )); then exit 1; fi
if (( connector == 2 || splice == 2 )); then exit 2; fi
exit 0
