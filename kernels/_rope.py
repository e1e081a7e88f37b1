"""Which rotary position embedding (RoPE) a model uses, and its frequencies.

Relocating a cached key from position ``p`` to ``p + d`` is one more rotation by ``d``
(``K(p + d) = R(d) K(p)``, exactly, per frequency pair), so all the relocation op needs
is the set of per-pair frequencies ``inv_freq`` and the pairing convention.  This module
computes ``inv_freq`` exactly as vLLM does (``RotaryEmbedding._compute_inv_freq`` in
``vllm/model_executor/layers/rotary_embedding/base.py`` and ``llama3_rope.py``), in
float32 with the same operations, so a relocated key rotates by the very frequencies the
engine used when it computed the key.

Only variants whose positional rotation is a pure per-pair rotation with fixed
frequencies are implemented: the default RoPE, Llama-3 frequency scaling and linear
position scaling.  The rest (YaRN, dynamic NTK, LongRoPE, M-RoPE, ...) are refused with
a :class:`~promptsplice.errors.ConfigError` naming them, rather than relocated wrongly.
"""

from __future__ import annotations

import json
import numbers
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from promptsplice.errors import ConfigError

__all__ = [
    "Llama3Scaling",
    "RopeConfig",
    "SUPPORTED_ROPE_TYPES",
    "GPTJ_STYLE_MODEL_TYPES",
    "NEOX_STYLE_MODEL_TYPES",
    "NOPE_MIXED_MODEL_TYPES",
]

#: ``rope_type`` values this package relocates exactly.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")

#: Model types whose vLLM implementation pairs dims (i, i + rotary_dim/2) (``is_neox_style``
#: True; vLLM's ``get_rope`` default).  Read from vllm/model_executor/models/*.py (0.32).
NEOX_STYLE_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "granite",
        "stablelm",
        "internlm2",
        "phi3",
        "minicpm",
    }
)

#: Model types whose vLLM implementation pairs dims (2i, 2i+1) (``is_neox_style=False``
#: in gpt_j.py, commandr.py, glm4.py).
GPTJ_STYLE_MODEL_TYPES = frozenset({"gptj", "cohere", "glm4"})

#: transformers' default ``partial_rotary_factor`` of model types that rotate part of
#: each head, for a config.json that leaves it out (its configuration_*.py): reading 1.0
#: there rotated every key of a StableLM or GLM-4 config wrongly.
_PARTIAL_ROTARY_DEFAULTS = {
    "gpt_neox": 0.25, "stablelm": 0.25, "qwen3_next": 0.25,
    "phi": 0.5, "glm": 0.5, "glm4": 0.5, "glm4_moe": 0.5, "persimmon": 0.5, "nemotron": 0.5,
}

#: Model types whose full-attention layers have no RoPE (vLLM's commandr.py applies it to
#: Cohere2's sliding layers only): refused, one rotation cannot serve both kinds.
NOPE_MIXED_MODEL_TYPES = frozenset({"cohere2"})


@dataclass(frozen=True, slots=True)
class Llama3Scaling:
    """Llama-3.1 frequency scaling (``rope_type: "llama3"``).

    High frequencies (wavelength below ``original_max_position_embeddings /
    high_freq_factor``) are kept, low ones divided by ``factor``, and the band between
    is interpolated smoothly; positions are not touched, so relocation stays a pure
    rotation with the scaled frequencies.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ConfigError(f"llama3 rope scaling: {name} must be a finite number, got {type(v).__name__} {v!r}")
        ompe = self.original_max_position_embeddings
        if isinstance(ompe, bool) or not isinstance(ompe, numbers.Integral):
            raise ConfigError(
                f"llama3 rope scaling: original_max_position_embeddings must be an int, got {type(ompe).__name__} {ompe!r}"
            )
        if not self.factor > 0:
            raise ConfigError(f"llama3 rope scaling: factor must be > 0, got {self.factor}")
        if not (self.low_freq_factor > 0 and self.high_freq_factor > 0):
            raise ConfigError(
                "llama3 rope scaling: low_freq_factor and high_freq_factor must be > 0, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "llama3 rope scaling: original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """The RoPE of one attention layer: enough to rotate its cached keys by a delta.

    * ``head_size``: channels per head; ``rotary_dim`` (even, ``<= head_size``) of them
      are rotated (partial rotary when smaller), the rest pass through unchanged.
    * ``theta``: the base (``rope_theta``).
    * ``is_neox_style``: pairing of the rotated channels.  True (neox): channel ``i``
      pairs with ``i + rotary_dim/2``; False (GPT-J): ``2i`` pairs with ``2i+1``.
    * ``llama3_scaling``: Llama-3 frequency scaling, or None.
    * ``linear_factor``: linear position scaling (``rope_type: "linear"``), i.e. every
      frequency divided by this factor; 1.0 means none.
    """

    head_size: int
    rotary_dim: int
    theta: float = 10000.0
    is_neox_style: bool = True
    llama3_scaling: Llama3Scaling | None = None
    linear_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("head_size", "rotary_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ConfigError(f"RopeConfig: {name} must be an int, got {type(v).__name__} {v!r}")
        for name in ("theta", "linear_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"RopeConfig: {name} must be a number, got {type(v).__name__} {v!r}")
        if self.head_size <= 0:
            raise ConfigError(f"RopeConfig: head_size must be > 0, got {self.head_size}")
        if not (0 < self.rotary_dim <= self.head_size) or self.rotary_dim % 2:
            raise ConfigError(
                "RopeConfig: rotary_dim must be even and in (0, head_size]; got "
                f"rotary_dim={self.rotary_dim}, head_size={self.head_size}"
            )
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ConfigError(f"RopeConfig: theta must be a finite number > 0, got {self.theta}")
        if not (self.linear_factor > 0 and math.isfinite(self.linear_factor)):
            raise ConfigError(f"RopeConfig: linear_factor must be a finite number > 0, got {self.linear_factor}")
        if not isinstance(self.is_neox_style, bool):
            raise ConfigError(f"RopeConfig: is_neox_style must be True or False, got {self.is_neox_style!r}")
        if self.llama3_scaling is not None and not isinstance(self.llama3_scaling, Llama3Scaling):
            raise ConfigError(
                f"RopeConfig: llama3_scaling must be a Llama3Scaling or None, got {type(self.llama3_scaling).__name__}"
            )

    @property
    def num_pairs(self) -> int:
        """Number of rotated channel pairs (``rotary_dim // 2``)."""
        return self.rotary_dim // 2

    def inv_freq(self) -> torch.Tensor:
        """The per-pair angular frequencies, float32 ``[rotary_dim // 2]``, on CPU.

        Bit-for-bit the values vLLM computes (same float32 operations, same order), so
        the rotation by a delta matches the engine's positions exactly.
        """
        inv = 1.0 / (
            self.theta
            ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim)
        )
        s = self.llama3_scaling
        if s is not None:
            low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            wave_len = 2 * math.pi / inv
            if s.low_freq_factor != s.high_freq_factor:
                smooth = (s.original_max_position_embeddings / wave_len - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
            else:
                smooth = 0
            inv = torch.where(
                wave_len < high_freq_wavelen,
                inv,
                torch.where(
                    wave_len > low_freq_wavelen,
                    inv / s.factor,
                    (1 - smooth) * inv / s.factor + smooth * inv,
                ),
            )
        if self.linear_factor != 1.0:
            inv = inv / self.linear_factor
        return inv

    @classmethod
    def from_hf_config(
        cls,
        cfg: Mapping[str, Any] | object | str | os.PathLike[str],
        *,
        is_neox_style: bool | None = None,
        layer_type: str | None = None,
    ) -> RopeConfig:
        """Read the RoPE a model applies from its Hugging Face config.

        ``cfg`` is a ``config.json`` dict, a ``PretrainedConfig``-like object, or a path
        to ``config.json`` (or to the model folder holding it).  Reads ``head_dim`` (else
        ``hidden_size / num_attention_heads``, or GPT-style ``n_embd / n_head``),
        ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``
        (older configs), and ``partial_rotary_factor`` (or its aliases ``rotary_pct`` /
        ``rotary_emb_fraction``; GPT-J's ``rotary_dim``).  A multimodal config's
        ``text_config`` is used when the top level has no attention fields.

        The pairing is not in the config: vLLM hard-codes it per model class.  It is
        looked up by ``model_type`` (:data:`NEOX_STYLE_MODEL_TYPES`,
        :data:`GPTJ_STYLE_MODEL_TYPES`); an unknown model type is refused unless
        ``is_neox_style`` is given, because the wrong pairing corrupts every key.
        Per-layer-type parameters (Gemma-3 style, nested ``rope_parameters``) need
        ``layer_type``.  Unimplemented scaling types raise :class:`ConfigError` naming
        the type.
        """
        try:
            return cls._from_hf_config(cfg, is_neox_style, layer_type)
        except ConfigError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:  # a field of the wrong type (inf)
            raise ConfigError(f"malformed RoPE fields in the model config: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _from_hf_config(cls, cfg: Any, is_neox_style: bool | None, layer_type: str | None) -> RopeConfig:
        d = _as_dict(cfg)
        attention_keys = ("head_dim", "hidden_size", "n_embd", "rope_parameters", "rope_theta")
        if not any(k in d for k in attention_keys):
            text = d.get("text_config")
            if text is not None:
                d = _as_dict(text)
        model_type = d.get("model_type")

        head_size = d.get("head_dim")
        if head_size is not None and (
            isinstance(head_size, bool) or not isinstance(head_size, (int, float)) or head_size != int(head_size)
        ):
            raise ConfigError(f"model config head_dim must be an int, got {head_size!r}")
        if not head_size:
            hidden = d.get("hidden_size") or d.get("n_embd") or d.get("d_model")
            heads = d.get("num_attention_heads") or d.get("n_head") or d.get("num_heads")
            if not hidden or not heads:
                raise ConfigError(
                    "model config names neither head_dim nor hidden_size and "
                    "num_attention_heads: cannot tell the head size"
                )
            head_size = int(hidden) // int(heads)
        head_size = int(head_size)

        pos = d.get("position_embedding_type")
        if pos is not None and str(pos).lower() not in ("rope", "rotary"):
            # Granite-4.0-H's "nope": vLLM builds no rotary embedding, so keys carry no position
            raise ConfigError(f"position_embedding_type {pos!r}: the keys carry no RoPE, so relocation "
                              "does not apply (only 'rope' is rotated)")
        if d.get("dual_chunk_attention_config"):
            raise ConfigError("dual-chunk attention RoPE is not supported for relocation")
        nope = d.get("no_rope_layers")
        if model_type in NOPE_MIXED_MODEL_TYPES or (isinstance(nope, list) and not all(nope)):
            # one RopeConfig rotates every layer's keys: a layer without RoPE would be corrupted
            raise ConfigError(
                f"model_type {model_type!r} mixes layers without RoPE (NoPE) with RoPE layers: "
                "relocation would rotate keys that carry no position; not supported"
            )

        local_theta = d.get("rope_local_base_freq")
        if local_theta is not None and not _is_nested(dict(d.get("rope_parameters") or {})):
            # older Gemma-3 configs: sliding layers use rope_local_base_freq, unscaled
            if layer_type is None:
                raise ConfigError(
                    "model config has per-layer-type RoPE (rope_local_base_freq for the sliding "
                    "layers): pass layer_type ('sliding_attention' or 'full_attention')"
                )
            if layer_type not in ("sliding_attention", "full_attention"):
                raise ConfigError(f"layer_type {layer_type!r}: pass 'sliding_attention' or 'full_attention'")
            if layer_type == "sliding_attention":
                d = {**d, "rope_theta": float(local_theta), "rope_scaling": None, "rope_parameters": None}

        params = _rope_params(d, layer_type)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "su":
            rope_type = "longrope"
        if rope_type == "mrope" or "mrope_section" in params or "xdrope_section" in params:
            raise ConfigError(
                "rope type 'mrope' (multimodal 3-D positions) is not supported for "
                f"relocation; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if params.get("use_fope"):
            raise ConfigError("Fourier RoPE (use_fope) is not supported for relocation")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope type {rope_type!r} is not supported for relocation (its rotation is "
                f"not implemented here); supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

        theta = float(
            params.get("rope_theta") or d.get("rope_theta") or d.get("rotary_emb_base") or 10000.0
        )

        if params.get("rope_dim"):
            rotary_dim = int(params["rope_dim"])
        elif model_type == "gptj" and d.get("rotary_dim"):
            rotary_dim = int(d["rotary_dim"])
        else:
            factor = params.get("partial_rotary_factor")
            for name in ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction"):
                if factor is None:
                    factor = d.get(name)
            if factor is None:  # transformers' own defaults where the config leaves it out
                factor = _PARTIAL_ROTARY_DEFAULTS.get(model_type, 1.0)
            factor = float(factor)
            if not 0.0 < factor <= 1.0:
                raise ConfigError(f"partial_rotary_factor={factor} must be in (0, 1]")
            rotary_dim = int(head_size * factor)

        if is_neox_style is None:
            if model_type in NEOX_STYLE_MODEL_TYPES:
                is_neox_style = True
            elif model_type in GPTJ_STYLE_MODEL_TYPES:
                is_neox_style = False
            else:
                raise ConfigError(
                    f"model_type {model_type!r}: RoPE pairing (neox or GPT-J) unknown for "
                    "this model; pass is_neox_style explicitly"
                )

        llama3 = None
        linear_factor = 1.0
        if rope_type == "llama3":
            try:
                llama3 = Llama3Scaling(
                    factor=float(params["factor"]),
                    low_freq_factor=float(params["low_freq_factor"]),
                    high_freq_factor=float(params["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        params["original_max_position_embeddings"]
                    ),
                )
            except KeyError as exc:
                raise ConfigError(f"llama3 rope scaling lacks {exc.args[0]!r}") from exc
        elif rope_type == "linear":
            if "factor" not in params:
                raise ConfigError("linear rope scaling lacks 'factor'")
            linear_factor = float(params["factor"])

        per_layer = d.get("layer_rope_theta")  # Granite: a base per layer, 0 = no RoPE
        if per_layer is not None:
            try:
                bases = {float(v) for v in per_layer}
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"layer_rope_theta must be a list of numbers, got {per_layer!r}") from exc
            if bases - {float(theta)}:
                # one RopeConfig rotates every layer's keys by one base
                raise ConfigError(
                    f"model config has per-layer RoPE bases (layer_rope_theta: {sorted(bases)}; 0 is a "
                    "layer without RoPE): relocation rotates every layer by one base; not supported"
                )

        return cls(
            head_size=head_size,
            rotary_dim=rotary_dim,
            theta=theta,
            is_neox_style=is_neox_style,  # checked in __post_init__: bool("False") was True
            llama3_scaling=llama3,
            linear_factor=linear_factor,
        )


def _as_dict(cfg: Any) -> dict[str, Any]:
    """A config as a plain dict (dict, path to config.json or its folder, or object)."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        path = Path(cfg)
        if path.is_dir():
            path = path / "config.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        out = dict(to_dict())
        # PretrainedConfig.to_dict may omit attributes set after construction.
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "head_dim"):
            if key not in out and hasattr(cfg, key):
                out[key] = getattr(cfg, key)
        return out
    try:
        return dict(vars(cfg))
    except TypeError as exc:
        raise ConfigError(f"cannot read a model config from {type(cfg).__name__}") from exc


def _is_nested(params: Mapping[str, Any]) -> bool:
    return bool(params) and all(isinstance(v, Mapping) or v is None for v in params.values())


def _rope_params(d: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The effective rope parameter dict (rope_parameters, else rope_scaling)."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if params and scaling and not _is_nested(dict(params)):
        # transformers (and so vLLM) takes rope_scaling over rope_parameters (a YaRN
        # rope_scaling added to a transformers-5 config.json was dropped here)
        kind = lambda p: p.get("rope_type", p.get("type", "default")) or "default"  # noqa: E731
        clash = [k for k, v in dict(scaling).items() if k != "type" and dict(params).get(k, v) != v]
        if kind(dict(params)) != kind(dict(scaling)) or clash:
            raise ConfigError(
                f"model config has both rope_parameters {dict(params)!r} and rope_scaling {dict(scaling)!r}, "
                "which disagree (transformers reads rope_scaling): remove the one the model does not use"
            )
    if not params:
        params = scaling
    params = dict(params or {})
    if _is_nested(params):
        if layer_type is None:
            raise ConfigError(
                "model config has per-layer-type rope parameters "
                f"({', '.join(sorted(params))}): pass layer_type"
            )
        if layer_type not in params or params[layer_type] is None:
            raise ConfigError(
                f"layer_type {layer_type!r} not in rope parameters ({', '.join(sorted(params))})"
            )
        params = dict(params[layer_type])
    # A flat config applies to every layer type, whatever layer_type says.
    return params
