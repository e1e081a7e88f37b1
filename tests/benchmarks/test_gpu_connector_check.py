"""benchmarks/gpu_connector_check.py runs the GPU check's code paths on CPU: its
correctness checks pass with the torch implementation and, in a subprocess where vLLM
cannot be imported (as on the GPU machine), with the Triton interpreter; without CUDA
the real check says so and exits 2.  The GPU run itself is not CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from promptsplice.benchmarks import gpu_connector_check as check

SPEED_KEYS = {"load": "ratio", "relocate": "ratio", "save": "slowdown"}


def _assert_doc(doc: dict, impl: str) -> None:
    assert doc["correct"] is True and doc["impl"] == impl and doc["quick"] is True
    combos = {(r["geometry"], r["layout"]) for r in doc["checks"]}
    assert combos == {(g.name, lay) for g in check.GEOMETRIES for lay in check.LAYOUTS}
    for r in doc["checks"]:
        assert r["ok"] and r["saved_exact"] and r["v_exact"] and r["deferred_until_waited"], r
        assert 0.0 < r["k_err_over_bound"] <= 1.0, r  # keys were rotated, within one bf16 step
    for part, key in SPEED_KEYS.items():
        assert isinstance(doc["speed"][part][key], float), doc["speed"]
    assert doc["speed"]["save"]["blocks_saved"] > 0
    assert set(doc["targets_met"]) == set(check.TARGETS)


def test_the_quick_cpu_run_passes_its_checks(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    _assert_doc(doc, "auto")
    printed = capsys.readouterr().out
    assert "| load with relocation / pinned H2D copy |" in printed  # the README table


def test_it_runs_without_vllm_through_the_triton_interpreter(tmp_path):
    out = tmp_path / "gpu.json"
    script = textwrap.dedent(
        """
        import sys
        sys.modules["vllm"] = None  # the GPU machine has PyTorch and Triton, no vLLM
        from promptsplice.benchmarks import gpu_connector_check
        loaded = [m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "vllm"]
        assert not loaded, loaded
        sys.exit(gpu_connector_check.main(sys.argv[1:]))
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", script, "--device", "cpu", "--quick", "--impl", "triton", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_doc(json.loads(out.read_text()), "triton")


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_device_script_installs_the_bare_tree_and_runs_the_check(tmp_path):
    """scripts/gpu_check.sh is what a GPU session runs on a bare machine (the tree not
    installed): here it installs the tree into a scratch folder and runs the CPU dry run
    from there, so the import path is the one the GPU machine will take."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # the README's form: a relative PYTHON, run from the tree's root
    python = os.path.relpath(sys.executable, root)
    env = dict(os.environ, PYTHON=python, OUT=str(tmp_path), TMPDIR=str(tmp_path))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [os.path.join(root, "scripts", "gpu_check.sh"), "--device", "cpu", "--quick"],
        env=env, cwd=root, capture_output=True, text=True, timeout=500,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    doc = json.loads((tmp_path / "gpu_connector_check.json").read_text())
    _assert_doc(doc, "auto")
    assert doc["module"].startswith(str(tmp_path)), doc["module"]  # the scratch install ran
    assert doc["impl_ran"] == "torch"  # what ran, not only what was asked ("auto")
    log = (tmp_path / "gpu_connector_check.log").read_text()
    assert "correctness" in log and log.rstrip().endswith("gpu_connector_check: exit 0")
    assert '"checks"' not in proc.stdout  # the JSON went to its file, not into the bounded log tail
    assert not any(p.name.startswith("promptsplice-site.") for p in tmp_path.iterdir())
