"""benchmarks/gpu_splice_check.py stays runnable: its checks pass on CPU tensors (torch
path) and, without CUDA, it says so and exits 2.  The GPU run itself is not CI."""

from __future__ import annotations

import pytest
import torch

from promptsplice.benchmarks import gpu_splice_check as script


def test_exits_clearly_without_cuda(capsys, monkeypatch):
    # On a CUDA machine the script would run for real: hide the device so the no-CUDA
    # path is tested everywhere (the real GPU run is not CI).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("layout_name", script.LAYOUTS)
def test_its_correctness_check_accepts_the_torch_path(layout_name):
    for i, case in enumerate(script.CASES[:3]):
        result = script.check_case(case, layout_name, torch.device("cpu"), seed=1000 + i)
        assert result["ok"], result
