"""The one module that touches vLLM: its logs stay off stdout (quiet by default, a
switch to see them), measured on a real engine start in a child process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from promptsplice.engine_adapters import _vllm
from promptsplice.errors import ConfigError

_ENGINE_RUN = """
import json, sys, time
t0 = time.perf_counter()
from promptsplice.engine_adapters import EmbeddedEngine
eng = EmbeddedEngine(kv_cache_bytes=64 << 20, max_model_len=1024)
t1 = time.perf_counter()
done = eng.generate(list(range(1000, 1300)), max_tokens=4)
t2 = time.perf_counter()
import vllm.v1.engine.core as core  # loaded by now: the last engine's close must shut its core down
calls, shutdown = [], core.EngineCore.shutdown
core.EngineCore.shutdown = lambda self: (calls.append(1), shutdown(self))[1]
eng.close()
print("TIMES " + json.dumps({"start_s": t1 - t0, "first_request_s": t2 - t1, "ttft_s": done.ttft_s,
                             "core_shutdowns": len(calls)}), file=sys.stderr)
"""


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", _vllm.LOGS_ENV))}
    env.update(extra)
    return env


@pytest.mark.reliability
def test_a_started_engine_prints_nothing_from_vllm_on_stdout():
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_RUN], capture_output=True, text=True, timeout=900, env=_child_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == ""  # vLLM printed ~90 INFO lines here per start before
    lines = out.stderr.splitlines()
    assert not [line for line in lines if re.search(r"pid=\d+\) INFO ", line)], "vLLM's INFO lines are off by default"
    times = json.loads(next(line for line in lines if line.startswith("TIMES "))[6:])
    # Reported, not asserted (shared, loaded machines): see the README for the numbers.
    print(f"\nengine start {times['start_s']:.1f} s, first request {times['first_request_s']:.2f} s "
          f"(TTFT {times['ttft_s']:.2f} s, 300 prompt tokens, 4 generated)")
    assert 0 < times["ttft_s"] <= times["first_request_s"]
    # the last engine's close shut vLLM's core down (its client's shutdown() did nothing once
    # the finalizer that gates it was detached: start-up memory and the event socket stayed)
    assert times["core_shutdowns"] == 1


# vLLM configures its logging when an engine is built (``EngineArgs.create_logging_config``
# -> ``configure_logging_if_needed``); the child does just that, without a model.
_LOG_LINE = """
from promptsplice.engine_adapters import _vllm
_vllm.import_vllm()
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger
configure_logging_if_needed(LoggingConfig())
_vllm.quiet_logs()
init_logger("vllm.promptsplice_test").info("PROMPTSPLICE-PROBE info line")
init_logger("vllm.promptsplice_test").warning("PROMPTSPLICE-PROBE warning line")
"""


@pytest.mark.parametrize(
    ("switch", "info_shown"), [(None, False), ("1", True), ("error", False)]
)
def test_the_switch_shows_vllm_logs_on_stderr_only(switch, info_shown):
    env = _child_env() if switch is None else _child_env(**{_vllm.LOGS_ENV: switch})
    out = subprocess.run([sys.executable, "-c", _LOG_LINE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PROMPTSPLICE-PROBE" not in out.stdout
    assert ("PROMPTSPLICE-PROBE info line" in out.stderr) is info_shown
    assert ("PROMPTSPLICE-PROBE warning line" in out.stderr) is (switch != "error")


def test_a_bad_switch_names_the_choices(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(_vllm, "_set_level_here", False)
    monkeypatch.setenv(_vllm.LOGS_ENV, "loud")
    with pytest.raises(ConfigError, match="PROMPTSPLICE_VLLM_LOGS='loud'.*1 .*0 "):
        _vllm.vllm_log_level()
    monkeypatch.setenv(_vllm.LOGS_ENV, "1")
    assert _vllm.vllm_log_level() == "INFO"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")  # the user's own vLLM setting wins
    assert _vllm.vllm_log_level() == "DEBUG"


def test_a_missing_vllm_names_the_extra_that_installs_it(monkeypatch):
    """On the ``[engine]`` install (vLLM comes with ``[cpu]`` or ``[gpu]``) building an
    engine ended in a bare ``No module named 'vllm'``."""
    import sys

    import pytest

    from promptsplice.engine_adapters import _vllm

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)
    for load in (_vllm.import_vllm, _vllm.import_vllm_platform):
        with pytest.raises(ModuleNotFoundError, match=r"needs vLLM.*pip install 'promptsplice\[cpu\]'") as info:
            load()
        assert info.value.name.split(".")[0] == "vllm"


def test_request_identities_of_different_adapters_or_inputs_never_coincide():
    """``lora=<name>@<path>`` joined by ``;``: an adapter ``x`` at ``y@/p`` and one
    ``x@y`` at ``/p`` gave one identity, so one adapter's stored KV was served to the
    other.  vLLM keys them by tuples; the identity is now JSON."""
    import types

    from vllm.lora.request import LoRARequest

    def req(lora=None, mm=(), rid="r1"):
        feats = [types.SimpleNamespace(identifier=i, mm_position=types.SimpleNamespace(offset=o)) for i, o in mm]
        return types.SimpleNamespace(request_id=rid, lora_request=lora, mm_features=feats, prompt_embeds=None)

    a = _vllm.request_identity(req(LoRARequest("x", 1, "y@/adapters/p")))
    b = _vllm.request_identity(req(LoRARequest("x@y", 2, "/adapters/p")))
    assert a != b and json.loads(a) == [["lora", "x", "y@/adapters/p"]]
    # "mm=img@3;mm=b@3" both ways under the old format
    assert _vllm.request_identity(req(mm=[("img@3;mm=b", 3)])) != _vllm.request_identity(req(mm=[("img", 3), ("b", 3)]))
    assert _vllm.request_identity(req()) is None


def test_only_a_multimodal_requests_blocks_before_its_first_input_are_hashed_as_plain_ones():
    """The taint check of such requests runs over those blocks only: a LoRA adapter or
    prompt embeddings key every block (checking them stopped a LoRA request's saves)."""
    import types

    from vllm.lora.request import LoRARequest

    def req(lora=None, offsets=(), embeds=None):
        feats = [types.SimpleNamespace(identifier=f"i{o}", mm_position=types.SimpleNamespace(offset=o)) for o in offsets]
        return types.SimpleNamespace(request_id="r", lora_request=lora, mm_features=feats, prompt_embeds=embeds)

    assert _vllm.plain_prefix_tokens(req(offsets=(300, 200))) == 200
    assert _vllm.plain_prefix_tokens(req(LoRARequest("x", 1, "/p"), offsets=(200,))) == 0
    assert _vllm.plain_prefix_tokens(req(offsets=(200,), embeds=object())) == 0
    assert _vllm.plain_prefix_tokens(req()) == 0


@pytest.mark.parametrize("value", ["", "false", "False", "no"])
def test_a_multiprocessing_switch_vllm_cannot_read_is_refused_naming_it(monkeypatch, value):
    """vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` as ``bool(int(...))``: "", "false"
    were taken as in-process here and then failed vLLM's start with a generic error."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
    with pytest.raises(ConfigError, match=f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r} is not an int.*set it to 0 or unset it"):
        _vllm.check_in_process("cpu")
    for fine in ("0", " 0 ", "00"):  # what int() reads as 0: in process
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", fine)
        _vllm.check_in_process("cpu")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "2")
    with pytest.raises(ConfigError, match="runs vLLM in this process"):
        _vllm.check_in_process("cpu")


def test_engine_kwargs_are_checked_against_vllms_own_arguments():
    """``vllm.LLM``'s own arguments (``chat_template``) and ``EngineArgs`` fields pass;
    anything else, or a key that is not a str, is a ConfigError before vLLM starts."""
    _vllm.check_engine_kwargs({"max_logprobs": -1, "chat_template": None, "enable_chunked_prefill": True})
    with pytest.raises(ConfigError, match="'gpu_mem_util', which vllm.LLM does not take"):
        _vllm.check_engine_kwargs({"gpu_mem_util": 0.5})
    with pytest.raises(ConfigError, match="extra_kwargs keys must be str"):
        _vllm.check_engine_kwargs({1: 2})
