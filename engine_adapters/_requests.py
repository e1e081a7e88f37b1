"""What a request to :class:`~promptsplice.engine_adapters.EmbeddedEngine` takes and
returns: the result records, and the checks that turn a prompt and options into token
ids and sampling arguments before anything reaches vLLM.

Kept apart from the engine (``_embedded``), which owns vLLM's lifetime and the one step
loop: nothing here imports vLLM or holds engine state, so every check is plain Python
and raises the documented error with the fix in its message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from promptsplice.assembler import AssembledPrompt, PrefixCacheMirror, Tokenizer, load_tokenizer, same_tokenizer
from promptsplice.blocks import chain_hashes
from promptsplice.engine_adapters.connector._plans import BlockDeviation, SplicePhase, SplicePlan
from promptsplice._validate import check_int, check_number, check_salt, check_stop, check_token_ids, encodable
from promptsplice.errors import ConfigError, ContextLengthError, InputError, InvalidSaltError, InvalidUTF8Error

__all__ = [
    "Adapt",
    "admit_run",
    "Completion",
    "EngineCounters",
    "NormalizedPrompt",
    "PhasedRun",
    "PhaseResult",
    "phase_list",
    "run_phases",
    "sent_plan",
    "PromptLike",
    "StreamDelta",
    "check_context",
    "check_tokenizer",
    "check_logprobs",
    "check_phase_options",
    "check_request_limits",
    "check_sampling",
    "check_splice",
    "logprob_dicts",
    "normalize_prompt",
    "stream_deltas",
]

PromptLike = AssembledPrompt | Sequence[int] | str
"""What :meth:`EmbeddedEngine.generate` takes."""

PROMPT_TOKENIZER_FIX = "assemble it with engine.make_assembler() (or Assembler(tokenizer=engine.tokenizer))"


def check_tokenizer(mine: Tokenizer, theirs: Any, what: str, fix: str) -> Tokenizer:
    """``theirs`` (any tokenizer spec) loaded, or ``ConfigError`` when it splits text
    otherwise than ``mine``, an engine's: ids it made would be other tokens to the model."""
    tok = load_tokenizer(theirs)
    if not same_tokenizer(mine, tok):
        raise ConfigError(
            f"{what} was made with the tokenizer {getattr(tok, 'name', type(tok).__name__)!r}, which "
            f"splits text otherwise than the engine's {getattr(mine, 'name', type(mine).__name__)!r}: its "
            f"token ids would be other tokens to this model; {fix}"
        )
    return tok


@dataclass(slots=True)
class Completion:
    """One finished request."""

    text: str
    """The generated text (vLLM's detokenization, stop strings removed)."""
    token_ids: list[int]
    """The generated token ids."""
    prompt_token_ids: list[int]
    prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens vLLM did not compute: served from its prefix cache or loaded by the
    KV connector (its own ``num_cached_tokens``)."""
    ttft_s: float
    """Seconds from submitting the request to the step that returned its first token."""
    total_s: float
    """Seconds from submitting the request until it finished."""
    finish_reason: str | None
    """vLLM's reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens``
    reached, or the context ``max_model_len`` filled up)."""
    predicted_cached_tokens: int | None = None
    """The engine's mirror's prediction for this request (its own prefix cache only:
    tokens the connector loads are not predicted); ``None`` with prefix caching off."""
    request_id: str = ""
    logprobs: list[dict[int, float]] | None = None
    """With ``generate(..., logprobs=k)``: per generated token, the log-probabilities
    of the ``k`` most likely tokens (``k=-1``: the whole vocabulary, for an engine
    started with ``extra_kwargs={"max_logprobs": -1}``) and of the sampled one."""

    @property
    def cached_tokens(self) -> int:
        """``num_cached_tokens`` under the name every other record uses for it
        (:class:`RemoteCompletion`, the runners' steps, the benches' reports)."""
        return self.num_cached_tokens

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engine computed (not served from the cache)."""
        return self.prompt_tokens - self.num_cached_tokens


class StreamDelta(NamedTuple):
    """What one engine step added to a streamed request (:meth:`EmbeddedEngine.stream`)."""

    text: str
    """New text since the previous delta (may be empty while vLLM holds text back
    to check a stop string)."""
    token_ids: list[int]
    """New token ids since the previous delta."""
    completion: Completion | None
    """Set on the last delta only: the finished request, as ``generate`` returns it."""


class PhasedRun(NamedTuple):
    """What :meth:`EmbeddedEngine.generate_phases` ran."""

    completions: list[Completion]
    """One per phase, in order; the last one carries the generation."""
    t_last: float
    """``time.perf_counter()`` when the last phase was submitted (TTFT = up to there + its ttft)."""
    relocated_tokens: int
    """Tokens the splice connector loaded at another position than they were computed at."""
    deviations: tuple[Any, ...] = ()
    """The probes' :class:`~promptsplice.engine_adapters.connector._plans.BlockDeviation`
    records, in the order the phases measured them."""
    phases: tuple[SplicePhase, ...] = ()
    """The phases that ran: the plan's, with any an ``adapt`` inserted (a recompute
    extended past a deviating block relocates one block less per extension)."""


class PhaseResult(NamedTuple):
    """What one phase's request returned, as an engine reports it to :func:`run_phases`."""

    completion: Completion
    relocated_tokens: int
    deviations: tuple[Any, ...] = ()


Adapt = Callable[[list[Any], SplicePhase], "list[SplicePhase] | None"]


def run_phases(
    tokens: Sequence[int],
    phases: Sequence[SplicePhase],
    run_one: Callable[[list[int], SplicePlan | None, dict[str, Any]], PhaseResult],
    gen: dict[str, Any],
    adapt: Adapt | None = None,
) -> PhasedRun:
    """The one phase loop of a multi-phase splice (``plan_phases`` /
    ``plan_segment_phases``), for every engine: each phase's request is
    ``tokens[:phase.end]`` with its plan (``run_one``: the engine's request); every
    phase but the last only prefills (``max_tokens=1``), the last takes ``gen``.
    ``adapt(deviations, next_phase)``, called after each phase but the last with what
    its probes measured (a planned probe left unmeasured reads as infinite), may return
    phases replacing ``next_phase`` (adaptive recompute: ``_plans.extend_recompute``)."""
    phases = phase_list(phases)  # (read twice: a generator was used up by the check)
    _check_phase_ends(phases, len(tokens))
    outs: list[Completion] = []
    devs: list[Any] = []
    pending, moved, i = list(phases), 0, 0
    t_last = time.perf_counter()
    while i < len(pending):
        phase, last = pending[i], i == len(pending) - 1
        plan = sent_plan(phase)
        t_last = time.perf_counter()
        res = run_one(list(tokens[: phase.end]), plan, gen if last else {"max_tokens": 1})
        outs.append(res.completion)
        moved += res.relocated_tokens
        devs += res.deviations
        if adapt is not None and not last and (repl := adapt(_with_unmeasured(plan, res.deviations), pending[i + 1])):
            pending[i + 1 : i + 2] = repl
            _check_phase_ends(pending, len(tokens))
        i += 1
    return PhasedRun(outs, t_last, moved, tuple(devs), tuple(pending))


def phase_list(phases: Any) -> list[Any]:
    """``generate_phases``' ``phases`` as a list (read twice: by the checks and by the
    loop); :class:`InputError` for one that is no iterable of phases or is empty
    (``None`` or an int raised a bare ``TypeError``)."""
    if isinstance(phases, (str, bytes, bytearray, Mapping, SplicePhase)) or not isinstance(phases, Iterable):
        raise InputError(f"phases must be a list of SplicePhase, got {type(phases).__name__}: "
                         "build them with plan_phases / plan_segment_phases")
    out = list(phases)
    if not out:
        raise InputError("generate_phases needs at least one phase: build them with plan_phases / "
                         "plan_segment_phases")
    return out


def sent_plan(phase: SplicePhase) -> SplicePlan | None:
    """The plan :func:`run_phases` sends with ``phase``'s request: ``None`` for a phase
    that loads, probes and asks nothing (a plain prefill).  A plan that only asks its
    exact blocks saved under the tenant's salt too (``save_exact``) goes out (until
    2026-12-08 dropped: the chunks the runner then indexed were never stored)."""
    plan = phase.plan
    return plan if plan is not None and (plan or plan.probes or plan.save_exact) else None


def _check_phase_ends(phases: Sequence[SplicePhase], n: int) -> None:
    """Phase ends rise and the last is the whole prompt (else a phase past the prompt
    sent fewer tokens than its plan covers, or the answer came from a prefix).  Each
    phase must be a :class:`SplicePhase` with an int end and a plan or ``None`` (a
    tuple, a float end or a dict plan raised a raw AttributeError or TypeError)."""
    for p in phases:
        if (not isinstance(p, SplicePhase) or isinstance(p.end, bool) or not isinstance(p.end, int)
                or not (p.plan is None or isinstance(p.plan, SplicePlan))):
            raise InputError(
                f"each phase must be a SplicePhase(end: int, plan: SplicePlan | None), got {p!r:.120}: "
                "build phases with plan_phases / plan_segment_phases")
    ends = [p.end for p in phases]
    if any(b <= a for a, b in zip(ends, ends[1:])) or ends[-1] != n or ends[0] < 1:
        raise InputError(
            f"phase ends must rise and the last must be the prompt's {n} tokens, got {ends}: "
            "build phases for these tokens with plan_phases / plan_segment_phases"
        )


def _with_unmeasured(plan: SplicePlan | None, deviations: Sequence[Any]) -> list[Any]:
    """What ``adapt`` sees of a phase's probes: the measured deviations, and an infinite
    one for each planned probe block the connector did not measure (a chunked prefill
    split its block, a quarantined step): the guard fails closed and recomputes, never
    taking a missing measurement for a small one."""
    seen = list(deviations)
    if plan is None or not plan.probes:
        return seen
    measured = {d.dst_start for d in seen}
    bs = plan.block_size
    for p in plan.probes:
        for b in range(p.num_blocks):
            start = p.dst_start + b * bs
            if start not in measured:
                seen.append(BlockDeviation(start, p.delta, (float("inf"),), (float("inf"),)))
    return seen


class EngineCounters(NamedTuple):
    """vLLM's prefix-cache counters (tokens, cumulative since the engine started)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    external_queries: int
    external_hits: int

    def since(self, earlier: EngineCounters) -> EngineCounters:
        """The counts between ``earlier`` and this reading."""
        return EngineCounters(*(a - b for a, b in zip(self, earlier)))

    @property
    def hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


class NormalizedPrompt(NamedTuple):
    """A prompt as the engine sends it."""

    ids: list[int]
    salt: str | None
    text: str | None
    """The text of a ``str`` prompt (vLLM keeps it for its output), else ``None``."""


def normalize_prompt(
    prompt: Any, cache_salt: str | None, *, block_size: int, encode: Callable[[str], list[int]]
) -> NormalizedPrompt:
    """Token ids and salt of an :class:`AssembledPrompt`, a list of token ids or a
    ``str`` (``encode``: vLLM's tokenizer).  ``InputError`` for an empty or malformed
    prompt, ``ConfigError`` for a bad ``cache_salt``.

    An assembled prompt's ``block_hashes`` are not reused: the prompt is a mutable
    record (ids edited in place, a salt changed), so the mirror hashes what is sent
    (~0.3 ms more for 8K tokens, after the request ran); its ids take the one rule too."""
    check_salt(cache_salt, "cache_salt")
    text: str | None = None
    if isinstance(prompt, AssembledPrompt):
        # (until 2026-12-08 copied unchecked, floats and bools reached vLLM, and the
        # hashes were reused whenever their count matched: the mirror filed blocks of
        # tokens never sent after an edit in place)
        ids = check_token_ids(prompt.token_ids, "prompt.token_ids")
        if cache_salt is not None and prompt.salt is not None and cache_salt != prompt.salt:
            # as RemoteEngine and PrefixRouter: one tenant's prompt sent as another's is refused
            raise InvalidSaltError(
                f"cache_salt={cache_salt!r} differs from the prompt's salt {prompt.salt!r}: "
                "assemble the prompt with the tenant's salt and leave cache_salt unset"
            )
        salt = prompt.salt if cache_salt is None else cache_salt
    elif isinstance(prompt, str):
        if not prompt:
            raise InputError("the prompt is empty: pass at least one token of text")
        if not encodable(prompt):  # as the router (vLLM's tokenizer raised a TokenizerError without a fix)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidUTF8Error.lone_surrogate("the prompt", prompt, exc, index=0, fix="pass valid text") from None
        ids = encode(prompt)
        text = prompt
        salt = cache_salt
    elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
        raise InputError(
            f"prompt must be an AssembledPrompt, a list of token ids or a str, got {type(prompt).__name__}"
        )
    else:
        ids = check_token_ids(prompt, "prompt")  # the one rule (RemoteEngine and the router take it too)
        salt = cache_salt
    if not ids:
        raise InputError("the prompt is empty: vLLM needs at least one prompt token")
    return NormalizedPrompt(ids, salt, text)


def check_context(num_tokens: int, max_model_len: int) -> None:
    """:class:`ContextLengthError` unless one position is left for a generated token."""
    if num_tokens >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {num_tokens} tokens but the engine's max_model_len is "
            f"{max_model_len} (a prompt may hold at most {max_model_len - 1}: one position "
            "is left for the first generated token); send fewer or shorter chunks, or start "
            "the engine with a larger max_model_len",
            prompt_tokens=num_tokens,
            max_tokens=max_model_len,
        )


def check_logprobs(logprobs: Any) -> None:
    """``logprobs``: None, -1 (the whole vocabulary) or a count >= 0."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < -1):
        raise ConfigError(f"logprobs must be None, -1 (all) or an int >= 0, got {logprobs!r}")


MAX_TEMPERATURE = 2.0
"""vLLM's highest ``temperature`` (``SamplingParams``; a server refuses more too).  Until
2026-12-07 only vLLM checked it, so ``generate_phases`` ran every phase but the last
before the refusal."""


def check_sampling(
    max_tokens: Any, temperature: Any, stop: Any, logprobs: Any = None
) -> dict[str, Any]:
    """The sampling options, checked: keyword arguments for ``_vllm.make_sampling_params``."""
    check_int(max_tokens, "max_tokens")
    check_number(temperature, "temperature")
    if temperature > MAX_TEMPERATURE:  # vLLM's bound: refused before any phase of generate_phases ran
        raise ConfigError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (vLLM's range), got {temperature!r}")
    stops = check_stop(stop)
    check_logprobs(logprobs)
    return {"max_tokens": max_tokens, "temperature": float(temperature), "stop": stops, "logprobs": logprobs}


PHASE_OPTIONS = ("max_tokens", "temperature", "stop", "logprobs")
"""The ``generate`` keyword arguments ``generate_phases(**gen)`` passes on to its last
phase (``cache_salt`` is its own argument, ``splice`` and the prompt come from the phases)."""


def check_phase_options(gen: dict[str, Any]) -> None:
    """``generate_phases``' ``**gen``, checked before any phase runs (every engine): a
    key ``generate`` does not take, or one the phases set themselves, and a bad value
    raise :class:`ConfigError` naming it, instead of a ``TypeError`` from the last
    phase after the earlier ones already ran."""
    for key in gen:
        if key not in PHASE_OPTIONS:
            why = ("is set by generate_phases itself (each phase's plan)" if key in ("splice", "prompt")
                   else "is not an option of generate")
            raise ConfigError(
                f"generate_phases got {key}={gen[key]!r}, which {why}: pass only "
                f"{', '.join(PHASE_OPTIONS)} (cache_salt and adapt are its own arguments)"
            )
    check_sampling(gen.get("max_tokens", 16), gen.get("temperature", 0.0), gen.get("stop"), gen.get("logprobs"))


def check_request_limits(ids: Sequence[int], logprobs: int | None, limits: tuple[int, int, int]) -> None:
    """What vLLM would refuse, refused before sending: ``limits`` is the engine's
    ``(max_logprobs, vocab_size, max_token_id)`` (``_vllm.request_limits``; an engine's
    ``max_logprobs=-1`` is already resolved to its vocabulary size).  :class:`InputError`
    for a prompt id outside the vocabulary, :class:`ConfigError` for more logprobs than
    the engine allows (``logprobs=-1`` asks for the whole vocabulary)."""
    max_logprobs, vocab, max_id = limits
    if ids:
        low, high = min(ids), max(ids)
        if low < 0 or high > max_id:
            bad = low if low < 0 else high
            raise InputError(
                f"the prompt holds token id {bad}, outside the model's vocabulary (ids 0..{max_id}): "
                "tokenize the prompt with the engine's tokenizer (engine.tokenizer)"
            )
    if logprobs:
        wanted = vocab if logprobs == -1 else logprobs
        if wanted > max_logprobs:
            raise ConfigError(
                f"logprobs={logprobs} asks for {wanted} log-probabilities per token, more than the "
                f"engine's max_logprobs ({max_logprobs}): ask for at most {max_logprobs}, or start the "
                'engine with extra_kwargs={"max_logprobs": -1} (the whole vocabulary)'
            )


def check_splice(splice: Any, *, has_store: bool, block_size: int) -> dict[str, Any] | None:
    """A splice plan's ``kv_transfer_params`` (``None`` without a plan)."""
    if splice is None:
        return None
    if not isinstance(splice, SplicePlan):
        raise ConfigError(
            f"splice must be a SplicePlan (plan_deletion / plan_relocation), got {type(splice).__name__}"
        )
    if not has_store:
        raise ConfigError("splice plans need the splice connector: start the engine with kv_store=StoreConfig(...)")
    if splice.block_size != block_size:
        raise ConfigError(
            f"the splice plan was made for block_size {splice.block_size}, the engine's is {block_size}"
        )
    return splice.to_params()


def logprob_dicts(out: Any) -> list[dict[int, float]]:
    """vLLM's per-token logprobs as plain ``{token_id: logprob}`` dicts."""
    lps = out.outputs[0].logprobs if out.outputs else None
    return [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (lps or [])]


def stream_deltas(steps: Iterator[tuple[Any, Completion | None]]) -> Iterator[StreamDelta]:
    """The engine step loop's cumulative outputs as deltas (``EmbeddedEngine.stream``)."""
    sent_text, sent_ids = "", 0
    for out, completion in steps:
        if completion is not None:
            # the final step's text (stop strings removed); a stop string can end the
            # text before what was already sent, in which case nothing more is added
            full = completion.text
            tail = full[len(sent_text) :] if full.startswith(sent_text) else ""
            yield StreamDelta(tail, completion.token_ids[sent_ids:], completion)
            continue  # the step loop ends after its completion
        gen = out.outputs[0] if out.outputs else None
        if gen is None:
            continue
        # cumulative output: send what is new since the last step
        new_text = gen.text[len(sent_text) :] if gen.text.startswith(sent_text) else ""
        new_ids = list(gen.token_ids[sent_ids:])
        if new_text or new_ids:
            sent_text += new_text
            sent_ids += len(new_ids)
            yield StreamDelta(new_text, new_ids, None)


def admit_run(mirror: PrefixCacheMirror, ids: list[int], gen: list[int], salt: str | None) -> int:
    """Replay one finished request into the engine's ``mirror``: the prompt ``ids`` and
    the generated tokens whose KV it computed (all but the last), under ``salt``; the
    mirror's prediction for it."""
    computed = len(ids) + max(0, len(gen) - 1)
    tokens = ids + gen[: max(0, len(gen) - 1)]
    hashes = chain_hashes(tokens, mirror.block_size, salt=salt)
    return mirror.admit(hashes, len(ids), num_computed_tokens=computed).cached_tokens
