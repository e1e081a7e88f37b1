"""RopeConfig: validation, frequencies, and reading it from model configs."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from promptsplice.kernels import Llama3Scaling, RopeConfig
from promptsplice.errors import ConfigError

LLAMA31 = {  # the shape of Llama-3.1-8B's config.json (legacy rope_scaling form)
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_the_real_default_model_reads_as_llama_neox_theta_1e5():
    from promptsplice.engine_adapters._model import ensure_default_model

    path = ensure_default_model() / "config.json"
    rope = RopeConfig.from_hf_config(path)
    assert rope == RopeConfig(head_size=64, rotary_dim=64, theta=100000.0, is_neox_style=True)
    # The same from the dict, and from the folder.
    assert RopeConfig.from_hf_config(json.loads(path.read_text())) == rope
    assert RopeConfig.from_hf_config(path.parent) == rope


def test_default_inv_freq_is_the_textbook_formula():
    rope = RopeConfig(head_size=64, rotary_dim=64, theta=100000.0)
    inv = rope.inv_freq()
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    expected = torch.tensor([100000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), expected, rtol=1e-6, atol=0)


def test_llama3_scaling_keeps_high_divides_low_and_blends_between():
    s = Llama3Scaling(8.0, 1.0, 4.0, 8192)
    plain = RopeConfig(head_size=128, rotary_dim=128, theta=500000.0).inv_freq().double()
    scaled = RopeConfig(head_size=128, rotary_dim=128, theta=500000.0, llama3_scaling=s)
    scaled = scaled.inv_freq().double()
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


def test_linear_scaling_divides_every_frequency():
    plain = RopeConfig(head_size=64, rotary_dim=64).inv_freq()
    lin = RopeConfig(head_size=64, rotary_dim=64, linear_factor=4.0).inv_freq()
    torch.testing.assert_close(lin, plain / 4)


def test_llama31_legacy_rope_scaling_and_transformers5_rope_parameters_agree():
    legacy = RopeConfig.from_hf_config(LLAMA31)
    assert legacy.head_size == 128 and legacy.rotary_dim == 128 and legacy.is_neox_style
    assert legacy.theta == 500000.0
    assert legacy.llama3_scaling == Llama3Scaling(8.0, 1.0, 4.0, 8192)
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(LLAMA31["rope_scaling"], rope_theta=500000.0)
    assert RopeConfig.from_hf_config(v5) == legacy
    # The legacy "type" key names the scaling too.
    old = dict(LLAMA31, rope_scaling={**LLAMA31["rope_scaling"], "type": "llama3"})
    del old["rope_scaling"]["rope_type"]
    assert RopeConfig.from_hf_config(old) == legacy


def test_partial_rotary_and_pairing_by_model_type():
    phi = {"model_type": "stablelm", "hidden_size": 2560, "num_attention_heads": 32,
           "rope_theta": 10000, "partial_rotary_factor": 0.25}
    rope = RopeConfig.from_hf_config(phi)
    assert (rope.head_size, rope.rotary_dim, rope.is_neox_style) == (80, 20, True)
    gptj = {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64}  # GPT-J-6B
    rope = RopeConfig.from_hf_config(gptj)
    assert (rope.head_size, rope.rotary_dim, rope.is_neox_style) == (256, 64, False)
    glm = {"model_type": "glm4", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32,
           "partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 10000.0}}
    rope = RopeConfig.from_hf_config(glm)
    assert (rope.rotary_dim, rope.is_neox_style) == (64, False)
    # Aliases: gpt-neox's rotary_pct.
    neox = {"model_type": "mistral", "head_dim": 128, "rotary_pct": 0.5, "rope_theta": 1e6}
    assert RopeConfig.from_hf_config(neox).rotary_dim == 64


def test_config_objects_and_nested_text_configs_are_read():
    obj = types.SimpleNamespace(**LLAMA31)
    assert RopeConfig.from_hf_config(obj) == RopeConfig.from_hf_config(LLAMA31)
    wrapped = {"model_type": "llava", "text_config": LLAMA31}
    assert RopeConfig.from_hf_config(wrapped) == RopeConfig.from_hf_config(LLAMA31)


@pytest.mark.parametrize(
    "rope_type", ["yarn", "dynamic", "longrope", "su", "deepseek_yarn", "ntk", "proportional"]
)
def test_unimplemented_scaling_types_are_refused_by_name(rope_type):
    cfg = dict(LLAMA31, rope_scaling={"rope_type": rope_type, "factor": 4.0})
    with pytest.raises(ConfigError) as err:
        RopeConfig.from_hf_config(cfg)
    named = "longrope" if rope_type == "su" else rope_type
    assert named in str(err.value) and "supported" in str(err.value)


def test_multimodal_and_unknown_models_are_refused():
    mrope = dict(LLAMA31, rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]})
    with pytest.raises(ConfigError, match="mrope"):
        RopeConfig.from_hf_config(mrope)
    unknown = {"model_type": "mystery", "head_dim": 64, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="is_neox_style"):
        RopeConfig.from_hf_config(unknown)
    assert not RopeConfig.from_hf_config(unknown, is_neox_style=False).is_neox_style
    with pytest.raises(ConfigError, match="head size"):
        RopeConfig.from_hf_config({"model_type": "llama", "rope_theta": 1.0})
    with pytest.raises(ConfigError, match="cannot read"):
        RopeConfig.from_hf_config("/nonexistent/config.json")


def test_per_layer_type_rope_needs_a_layer_type():
    gemma3 = {
        "model_type": "gemma2",
        "head_dim": 256,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    with pytest.raises(ConfigError, match="layer_type"):
        RopeConfig.from_hf_config(gemma3)
    full = RopeConfig.from_hf_config(gemma3, layer_type="full_attention")
    assert (full.theta, full.linear_factor) == (1e6, 8.0)
    local = RopeConfig.from_hf_config(gemma3, layer_type="sliding_attention")
    assert (local.theta, local.linear_factor) == (1e4, 1.0)


def test_older_gemma3_configs_name_the_sliding_layers_theta():
    """``rope_local_base_freq`` (the pre-transformers-5 form) was ignored: every layer
    read as the full layers' theta 1e6 with linear x8, the sliding layers' 1e4 lost."""
    gemma3 = {"model_type": "gemma3_text", "head_dim": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    with pytest.raises(ConfigError, match="rope_local_base_freq.*pass layer_type"):
        RopeConfig.from_hf_config(gemma3)
    with pytest.raises(ConfigError, match="rope_local_base_freq"):
        RopeConfig.from_hf_config({"model_type": "gemma3", "text_config": gemma3})
    full = RopeConfig.from_hf_config(gemma3, layer_type="full_attention")
    assert (full.theta, full.linear_factor) == (1e6, 8.0)
    local = RopeConfig.from_hf_config(gemma3, layer_type="sliding_attention")
    assert (local.theta, local.linear_factor) == (1e4, 1.0)


def test_models_with_layers_without_rope_are_refused():
    """Cohere2 (Command-R7B) applies RoPE on its sliding layers only; one RopeConfig
    rotated the keys of its NoPE layers too (a -32 relocation changed them by 90%)."""
    cohere2 = {"model_type": "cohere2", "head_dim": 128, "rope_theta": 50000.0,
               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
    with pytest.raises(ConfigError, match="NoPE"):
        RopeConfig.from_hf_config(cohere2)
    llama4 = dict(LLAMA31, model_type="llama", no_rope_layers=[1, 1, 1, 0])
    with pytest.raises(ConfigError, match="NoPE"):
        RopeConfig.from_hf_config(llama4)
    assert RopeConfig.from_hf_config(dict(LLAMA31, no_rope_layers=[1, 1, 1, 1])).theta == 500000.0


def test_per_layer_rope_bases_are_refused():
    """Granite's ``layer_rope_theta`` (vLLM reads a base per layer, 0 = no RoPE) was
    ignored: every layer's keys were rotated by the one global base."""
    granite = {"model_type": "granite", "hidden_size": 512, "num_attention_heads": 8, "head_dim": 64,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    for bases in ([10000.0, 0.0, 10000.0, 1000000.0], [10000.0, 500000.0]):
        with pytest.raises(ConfigError, match="per-layer RoPE bases"):
            RopeConfig.from_hf_config(dict(granite, layer_rope_theta=bases))
    with pytest.raises(ConfigError, match="layer_rope_theta must be a list of numbers"):
        RopeConfig.from_hf_config(dict(granite, layer_rope_theta=["x"]))
    # one base everywhere is the global one
    assert RopeConfig.from_hf_config(dict(granite, layer_rope_theta=[10000.0] * 4)).theta == 10000.0


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        ({"model_type": "llama", "head_dim": "abc"}, "head_dim must be an int, got 'abc'"),
        ({"model_type": "llama", "head_dim": 64, "rope_theta": "x"}, "malformed RoPE fields.*'x'"),
        ({"model_type": "llama", "head_dim": 64, "rope_scaling": [1]}, "malformed RoPE fields"),
        (dict(LLAMA31, rope_scaling=dict(LLAMA31["rope_scaling"], factor=None)), "malformed RoPE fields.*NoneType"),
        ({"model_type": "llama", "head_dim": 64.9}, "head_dim must be an int, got 64.9"),  # was truncated to 64
        ({"model_type": "llama", "head_dim": "64"}, "head_dim must be an int, got '64'"),
        ({"model_type": "llama", "head_dim": 64, "rope_theta": float("inf")}, "theta must be a finite number > 0, got inf"),
    ],
)
def test_malformed_fields_are_config_errors(cfg, says):
    """A field of the wrong type escaped as TypeError/ValueError, which the connector
    (catching ConfigError to run without relocation) let crash the engine's start."""
    with pytest.raises(ConfigError, match=says):
        RopeConfig.from_hf_config(cfg)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(head_size="64", rotary_dim=64), "head_size must be an int, got str '64'"),
        (dict(head_size=64, rotary_dim=64.0), "rotary_dim must be an int, got float 64.0"),
        (dict(head_size=True, rotary_dim=64), "head_size must be an int, got bool True"),
        (dict(head_size=0, rotary_dim=0), "head_size must be > 0, got 0"),
        (dict(head_size=64, rotary_dim=65), r"rotary_dim must be even and in \(0, head_size\]; got rotary_dim=65"),
        (dict(head_size=64, rotary_dim=63), "got rotary_dim=63, head_size=64"),
        (dict(head_size=64, rotary_dim=128), "got rotary_dim=128, head_size=64"),
        (dict(head_size=64, rotary_dim=64, theta=0.0), "theta must be a finite number > 0, got 0.0"),
        (dict(head_size=64, rotary_dim=64, linear_factor=0.0), "linear_factor must be a finite number > 0, got 0.0"),
    ],
)
def test_invalid_configs_are_refused(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        RopeConfig(**kwargs)


def test_configs_are_frozen_slotted_values():
    rope = RopeConfig(head_size=64, rotary_dim=64)
    with pytest.raises(AttributeError):
        rope.theta = 1.0  # type: ignore[misc]
    assert not hasattr(rope, "__dict__")
    assert hash(rope) == hash(RopeConfig(head_size=64, rotary_dim=64))
    with pytest.raises(ConfigError):
        Llama3Scaling(0.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RopeConfig(64, 64, is_neox_style="false"), "is_neox_style must be True or False"),  # truthy: neox
        # from_hf_config took bool("False"): neox pairing for a GPT-J model, every key wrong
        (lambda: RopeConfig.from_hf_config({"model_type": "gptj", "head_dim": 64, "rope_theta": 1e4},
                                           is_neox_style="False"), "is_neox_style must be True or False"),
        (lambda: RopeConfig(64, 64, linear_factor=float("inf")), "linear_factor must be a finite"),  # no rotation
        (lambda: RopeConfig(64, 64, llama3_scaling={"factor": 8}), "llama3_scaling must be a Llama3Scaling"),
        (lambda: Llama3Scaling("8", 1, 4, 8192), "factor must be a finite number"),  # raw TypeError
        (lambda: Llama3Scaling(float("inf"), 1, 4, 8192), "factor must be a finite number"),
        (lambda: Llama3Scaling(8, 1, 4, 2.5), "original_max_position_embeddings must be an int"),
    ],
)
def test_rope_fields_that_would_rotate_wrongly_are_refused(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize(("model_type", "pairing", "rotary"), [
    ("stablelm", None, 16), ("glm4", None, 32), ("gpt_neox", True, 16), ("phi", True, 32),
])
def test_a_partial_rotary_model_without_its_factor_takes_transformers_default(model_type, pairing, rotary):
    """A StableLM / GLM-4 config.json without ``partial_rotary_factor`` was read as full
    rotary: every key rotated over the wrong channels (transformers defaults 0.25 / 0.5)."""
    cfg = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "rope_theta": 10000.0}
    rope = RopeConfig.from_hf_config(cfg, is_neox_style=pairing)
    assert (rope.head_size, rope.rotary_dim) == (64, rotary)



def test_an_infinite_head_dim_is_a_config_error():
    """int(inf) raised a raw OverflowError."""
    with pytest.raises(ConfigError, match="malformed RoPE fields .* OverflowError"):
        RopeConfig.from_hf_config({"head_dim": float("inf"), "rope_theta": 1e4})


def test_rope_scaling_beside_rope_parameters_is_read_or_refused_never_dropped():
    """transformers (so vLLM) takes rope_scaling over rope_parameters: Qwen's YaRN recipe
    adds rope_scaling to a config.json that transformers 5 saved with rope_parameters,
    and the YaRN was dropped here (relocated keys 98% off vLLM's)."""
    base = {"model_type": "qwen2", "hidden_size": 1024, "num_attention_heads": 16}
    v5 = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match="both rope_parameters .* and rope_scaling .* which disagree"):
        RopeConfig.from_hf_config({**v5, "rope_scaling": yarn})
    with pytest.raises(ConfigError, match="yarn"):  # an empty rope_parameters: the scaling is read
        RopeConfig.from_hf_config({**base, "rope_parameters": {}, "rope_scaling": yarn})
    # the two forms of one configuration agree: read once
    llama = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    both = dict(LLAMA31, rope_parameters=dict(llama, rope_theta=500000.0))
    assert RopeConfig.from_hf_config(both) == RopeConfig.from_hf_config(LLAMA31)


def test_a_layer_type_and_a_position_embedding_that_are_not_rope_are_refused():
    gemma3 = {"model_type": "gemma3_text", "head_dim": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    with pytest.raises(ConfigError, match="layer_type 'sliding': pass 'sliding_attention' or 'full_attention'"):
        RopeConfig.from_hf_config(gemma3, layer_type="sliding")  # was read as a full layer
    granite = {"model_type": "granitemoehybrid", "hidden_size": 1536, "num_attention_heads": 12,
               "position_embedding_type": "nope"}
    with pytest.raises(ConfigError, match="position_embedding_type 'nope'"):
        RopeConfig.from_hf_config(granite, is_neox_style=True)
