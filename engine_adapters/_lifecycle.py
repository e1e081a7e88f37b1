"""The embedded engine's lifetime: starting vLLM in this process, shutting it down (also
from a finalizer), and the tokenizer that matches the loaded model.

Several in-process engines share process-wide vLLM state (torch.distributed groups, the
worker-side KV connector slot), so the full shutdown runs only with the last live engine
(:func:`promptsplice.engine_adapters._vllm.shutdown_llm`); a count of live engines
decides.  The handle holds the vLLM object and the engine's connector agent, never the
engine itself, so a forgotten engine is still collected and shut down.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from promptsplice.assembler import HFTokenizer, Tokenizer
from promptsplice.engine_adapters import _vllm
from promptsplice.engine_adapters._config import EngineConfig, detect_platform
from promptsplice.errors import ConfigError, EngineStartError, TokenizerError

_log = logging.getLogger(__name__)

__all__ = ["Handle", "load_tokenizer", "release", "start_llm"]


class Handle:
    """The vLLM object of one engine start and its worker-side KV connector (``None``
    without one); ``llm`` is ``None`` once shut down."""

    __slots__ = ("llm", "kv")

    def __init__(self, llm: Any, kv: _vllm.AgentBox) -> None:
        self.llm = llm
        self.kv = kv


_live_lock = threading.Lock()
_live_engines = 0


def start_llm(config: EngineConfig) -> Handle:
    """Start ``vllm.LLM`` for ``config`` (``model`` resolved); :class:`EngineStartError`
    when vLLM cannot start (a KV cache too small names ``kv_cache_bytes``)."""
    global _live_engines
    vllm = _vllm.import_vllm()
    here = detect_platform()
    if config.platform != here:  # its defaults (block size, eager, KV bound) are another machine's
        raise ConfigError(
            f"EngineConfig(platform={config.platform!r}) describes another machine: vLLM here runs on {here!r}; "
            "leave platform=None to detect it (until 2026-12-07 such a config started, with a GPU's compiled "
            "mode and unbounded KV cache on CPU)")
    _vllm.check_in_process(config.platform)
    _vllm.check_engine_kwargs(config.extra_kwargs)  # a typo failed vLLM's start as a TypeError
    kwargs = config.llm_kwargs(config.model)  # type: ignore[arg-type]
    kv = _vllm.AgentBox()
    # Counted live while it starts: an engine closed meanwhile is then not the last, and
    # its full shutdown no longer tore down the process-wide state this one starts on.
    with _live_lock:
        _live_engines += 1
    try:
        with _vllm.agent_installed(kv, capture=True):  # a connector engine creates its agent here
            llm = vllm.LLM(**kwargs)
    except BaseException as exc:
        with _live_lock:
            _live_engines -= 1
        if not isinstance(exc, Exception):
            raise
        # vLLM's frames in the traceback held the half-built engine (its LLM, engine
        # core, weights: ~750 MB) for as long as the caller kept the error
        traceback.clear_frames(exc.__traceback__)
        raise _start_error(config, exc) from exc
    handle = Handle(llm, kv)
    try:
        _vllm.quiet_logs()
        _vllm.detach_vllm_finalizer(llm)
        if config.max_model_len is None:
            _notice_fitted_length(config, llm)
    except BaseException:  # (Ctrl-C too) no handle reaches the caller: shut it down here
        release(handle)
        raise
    return handle


def _notice_fitted_length(config: EngineConfig, llm: Any) -> None:
    """The default context length was lowered to what the KV cache holds: say so."""
    _, _, got = _vllm.engine_geometry(llm)
    own = _vllm.model_context_len(llm)
    if got < own:
        if config.kv_cache_bytes is None:  # vLLM's share of the GPU's memory
            size, fix = "vLLM's share of the GPU memory", "raise gpu_memory_utilization (extra_kwargs)"
        else:
            size, fix = f"kv_cache_bytes={config.kv_cache_bytes} ({config.kv_cache_bytes / 2**20:.1f} MiB)", \
                "raise kv_cache_bytes"
        _log.warning(
            "max_model_len=%d, not the model's own %d: the KV cache (%s) holds at most %d tokens "
            "per request; %s to get the full context, or pass max_model_len to choose one (a cache "
            "too small for it then fails the start)", got, own, size, got, fix,
        )


def _start_error(cfg: EngineConfig, exc: BaseException) -> EngineStartError:
    if _vllm.is_kv_cache_too_small(exc):
        if cfg.kv_cache_bytes is None:  # vLLM's share of the GPU's memory ("raise kv_cache_bytes" named None)
            size, fix = "vLLM's share of the GPU memory", "raise gpu_memory_utilization (extra_kwargs) or set kv_cache_bytes"
        else:
            size, fix = f"kv_cache_bytes={cfg.kv_cache_bytes} ({cfg.kv_cache_bytes / 2**20:.1f} MiB)", "raise kv_cache_bytes"
        if cfg.max_model_len is None:
            return EngineStartError(
                f"the KV cache ({size}) cannot hold a single block of a request, so no "
                f"context length fits: {fix}. vLLM said: {exc}"
            )
        return EngineStartError(
            f"the KV cache ({size}) cannot hold one request of max_model_len="
            f"{cfg.max_model_len} tokens: {fix} or lower max_model_len. "
            f"vLLM said: {exc}"
        )
    if cfg.kv_cache_bytes is not None and _vllm.is_kv_cache_over_memory(exc):
        return EngineStartError(
            f"kv_cache_bytes={cfg.kv_cache_bytes} ({cfg.kv_cache_bytes / 2**20:.1f} MiB) is more than this "
            f"machine's free memory: lower kv_cache_bytes, or free memory. vLLM said: {exc}")
    return EngineStartError(f"vLLM could not start {cfg.model!r}: {type(exc).__name__}: {exc}")


def release(handle: Handle) -> None:
    """Shut the engine's vLLM down; the process-wide state goes with the last one."""
    global _live_engines
    llm = handle.llm
    if llm is None:
        return
    try:
        # "last" is decided under the agent lock a start holds around vllm.LLM(): decided
        # before it, a last engine's full shutdown tore down the process-wide state another
        # thread's engine was starting on (a start counts itself live before it waits).
        # The handle lets go of its engine only under that lock: an interrupt while
        # waiting for it (another engine's start takes minutes) left the engine unreleased
        # for good and the live count too high (until 2026-12-08)
        with _vllm.agent_installed(handle.kv, capture=True):  # vLLM shuts down the slot's connector
            with _live_lock:
                if handle.llm is None:  # another thread released it meanwhile
                    return
                handle.llm = None
                _live_engines -= 1
                last = _live_engines == 0
            _vllm.shutdown_llm(llm, last_engine=last)
    except Exception:  # noqa: BLE001 - a dead engine's shutdown may fail; a restart must still run
        _log.exception("shutting down a vLLM engine failed (its resources may linger)")


def _is_default_model(folder: Path) -> bool:
    """Whether ``folder`` is the default model promptsplice converted from the GGUF (its
    tokenizer is the default tokenizer).  A model of the user's own that
    ``PROMPTSPLICE_MODEL_DIR`` names (no marker) is not: it was tokenized with SmolLM2's
    tokenizer while vLLM ran it with its own."""
    from promptsplice.assets import default_model_dir, is_complete

    try:
        return folder.resolve() == default_model_dir().resolve() and is_complete(folder)
    except OSError:
        return False


def _model_dir(model: str) -> Path | None:
    """The folder a chat renderer reads ``model``'s template from: the model folder, or
    for a hub id the snapshot vLLM loaded from Hugging Face's cache (``None``: not found;
    a render then asks for ``template=``)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "tokenizer_config.json")
    except Exception:  # an id the hub client refuses: no folder, never an engine failure
        return None
    return Path(found).parent if isinstance(found, str) else None


def load_tokenizer(model: str, get_llm: Callable[[], Any]) -> Tokenizer:
    """An assembler tokenizer that tokenizes exactly as the engine: the model folder's
    own ``tokenizer.json`` (the default model shares the default tokenizer and its token
    cache), else the fast tokenizer vLLM loaded for a hub model."""
    folder = Path(model)
    if folder.is_dir():
        if _is_default_model(folder):
            from promptsplice.assembler import default_tokenizer

            return default_tokenizer()
        if (folder / "tokenizer.json").is_file():
            return HFTokenizer.from_file(folder / "tokenizer.json")
    try:
        return HFTokenizer(get_llm().get_tokenizer(), name=f"hf:{model}", model_dir=_model_dir(model))
    except TokenizerError:
        raise
    except Exception as exc:
        raise TokenizerError(f"cannot build an assembler tokenizer for {model!r}: {exc}") from exc
