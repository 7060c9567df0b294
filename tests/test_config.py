"""MoEConfig validation, YAML loading, and the seeded weights and tokens."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import flashdmoe
from flashdmoe import reference
from flashdmoe.config import MAX_CONFIG_BYTES, MoEConfig, load_yaml_mapping_text, make_tokens, make_weights
from flashdmoe.validation import MAX_CAPACITY, validate_moe_inputs

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"

VALID = dict(hidden=16, ffn=24, experts=8, top_k=2, tokens_per_rank=10, world_size=2)
TINY_TEXT = (CONFIG_DIR / "tiny.yaml").read_text()


def config_with(**changes) -> MoEConfig:
    return MoEConfig(**{**VALID, **changes})


def test_defaults_and_derived_sizes():
    config = config_with()
    assert (config.activation, config.normalize_topk, config.capacity_factor) == ("gelu", True, None)
    assert (config.dtype, config.seed, config.steps) == ("float32", 0, 1)
    assert config.torch_dtype is torch.float32
    assert config.local_experts == 4
    assert config.w1_cols == 24
    assert config_with(activation="swiglu").w1_cols == 48
    assert config_with(dtype="bfloat16").torch_dtype is torch.bfloat16
    assert config_with(dtype="float16").torch_dtype is torch.float16
    assert config.expert_range(1) == range(4, 8)


@pytest.mark.parametrize(
    "field, value, expected_text",
    [
        ("hidden", 0, ">= 1"),
        ("hidden", -3, ">= 1"),
        ("hidden", 16.0, "integer"),
        ("hidden", True, "integer"),
        ("ffn", 0, ">= 1"),
        ("ffn", "24", "integer"),
        ("experts", 0, ">= 1"),
        ("experts", 7, "multiple of world_size=2"),
        ("top_k", 0, ">= 1"),
        ("top_k", 9, "top_k <= experts=8"),
        ("top_k", 2.5, "integer"),
        ("tokens_per_rank", -1, ">= 0"),
        ("world_size", 0, ">= 1"),
        ("world_size", 3, "multiple of world_size=3"),
        ("seed", -1, ">= 0"),
        ("seed", 2**63, "2**63 - 1"),
        ("steps", 0, ">= 1"),
        ("activation", "tanh", "relu, gelu, silu, swiglu"),
        ("activation", None, "relu, gelu, silu, swiglu"),
        ("normalize_topk", 1, "true or false"),
        ("normalize_topk", "yes", "true or false"),
        ("capacity_factor", 0, "> 0"),
        ("capacity_factor", -1.5, "> 0"),
        ("capacity_factor", math.inf, "finite"),
        ("capacity_factor", math.nan, "finite"),
        ("capacity_factor", True, "real number > 0"),
        ("capacity_factor", "1.0", "real number > 0"),
        ("dtype", "float64", "float32, bfloat16, float16"),
        ("dtype", "fp16", "float32, bfloat16, float16"),
        ("nodes", 0, ">= 1"),
        ("nodes", 1.0, "integer"),
        ("nodes", 3, "divisor of world_size=2"),
        ("exchange", "relay", "direct or hierarchical"),
        ("exchange", "hierarchical", "nodes >= 2"),
    ],
)
def test_invalid_field_names_field_value_and_range(field, value, expected_text):
    with pytest.raises(ValueError) as raised:
        config_with(**{field: value})
    message = str(raised.value)
    # "experts=7" when world_size is the field: the message names the pair that conflicts.
    named = "experts" if (field, value) == ("world_size", 3) else field
    assert message.startswith(f"{named}="), message
    assert expected_text in message, message


def test_valid_edge_values_are_accepted():
    assert config_with(tokens_per_rank=0).tokens_per_rank == 0
    assert config_with(top_k=8).top_k == 8
    assert config_with(capacity_factor=2).capacity_factor == 2.0
    assert isinstance(config_with(capacity_factor=2).capacity_factor, float)
    assert config_with(world_size=8, experts=8).local_experts == 1
    assert (config_with().nodes, config_with().ranks_per_node) == (1, 2)
    assert config_with(world_size=8, experts=8, nodes=4).ranks_per_node == 2
    assert config_with().exchange == "direct"
    assert config_with(nodes=2, exchange="hierarchical").exchange == "hierarchical"


def test_config_is_immutable_and_replace_revalidates():
    config = config_with()
    with pytest.raises(AttributeError):
        config.hidden = 3  # type: ignore[misc]
    assert config.replace(world_size=1).world_size == 1
    with pytest.raises(ValueError, match="top_k=9"):
        config.replace(top_k=9)


def test_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ValueError) as raised:
        MoEConfig.from_dict({**VALID, "hiden": 3, "experts_per_rank": 2})
    message = str(raised.value)
    assert "unknown key(s) experts_per_rank, hiden" in message
    assert "allowed keys: hidden, ffn" in message
    with pytest.raises(ValueError, match="missing required key\\(s\\) top_k, tokens_per_rank"):
        MoEConfig.from_dict({"hidden": 4, "ffn": 4, "experts": 2})
    with pytest.raises(ValueError, match="expected a mapping"):
        MoEConfig.from_dict([1, 2])  # type: ignore[arg-type]


def test_to_dict_round_trips_through_yaml(tmp_path):
    config = config_with(activation="swiglu", capacity_factor=1.25, dtype="bfloat16", seed=7, steps=4)
    path = tmp_path / "layer.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert MoEConfig.from_yaml(path) == config


@pytest.mark.parametrize(
    "text, expected",
    [
        ("- 1\n- 2\n", "expected a mapping of field names to values, got list"),
        ("just a string\n", "expected a mapping of field names to values, got str"),
        ("", "the file is empty"),
        ("hidden: [1, 2\n", "not valid YAML"),
        ("hidden: 8\nffn: 8\nexperts: 4\ntop_k: 2\ntokens_per_rank: 4\nactivaton: relu\n", "unknown key(s) activaton"),
        ("hidden: 8\nffn: 8\nexperts: 4\ntop_k: 5\ntokens_per_rank: 4\n", "top_k=5"),
    ],
)
def test_from_yaml_errors_name_the_file_and_problem(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as raised:
        MoEConfig.from_yaml(path)
    assert str(path) in str(raised.value)
    assert expected in str(raised.value)


def test_from_yaml_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.yaml: no such file"):
        MoEConfig.from_yaml(tmp_path / "absent.yaml")


def test_from_yaml_refuses_what_is_not_a_readable_utf8_file(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=f"^{tmp_path}: is a directory; expected a YAML config file$"):
        MoEConfig.from_yaml(tmp_path)

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(TINY_TEXT.encode() + "# réglé\n".encode("latin-1"))
    with pytest.raises(ValueError) as raised:
        MoEConfig.from_yaml(latin1)
    lines = TINY_TEXT.count("\n") + 1
    assert str(raised.value) == (f"{latin1}: not UTF-8 text (byte 0xe9 on line {lines}); expected a UTF-8 YAML "
                                 "config file")

    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="huge.yaml: larger than 1,048,576 bytes"):
        MoEConfig.from_yaml(huge)

    # Unreadable: a permission error from open() (mode bits do not stop root, so it is injected here;
    # tests/test_cli_errors.py makes a really unreadable file for the CLI).
    locked = tmp_path / "locked.yaml"
    locked.write_text(TINY_TEXT)
    real_open = open

    def refusing_open(path, *args, **kwargs):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(ValueError, match=f"^{locked}: cannot be read: Permission denied$"):
        MoEConfig.from_yaml(locked)


@pytest.mark.parametrize("text, key, line, first", [
    ("hidden: 8\nffn: 8\nexperts: 4\ntop_k: 2\ntokens_per_rank: 4\nhidden: 16\n", "hidden", 6, 1),
    ("{hidden: 8, ffn: 8, experts: 4, top_k: 2, tokens_per_rank: 4, top_k: 1}\n", "top_k", 1, 1),
    ("hidden: 8\nffn: 8\nexperts: 4\ntop_k: 2\ntokens_per_rank: 4\nseed: 1\nsteps: 2\nseed: 1\n", "seed", 8, 6),
])
def test_from_yaml_refuses_duplicate_keys_naming_key_and_lines(tmp_path, text, key, line, first):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as raised:
        MoEConfig.from_yaml(path)
    assert str(raised.value) == f"{path}: duplicate key {key!r} on line {line} (first given on line {first})"


def test_yaml_loader_keeps_safe_load_types_and_merge_keys():
    text = ("base: &base {hidden: 8, ffn: 8}\nlayer:\n  <<: *base\n  hidden: 16\n  when: 2024-01-02\n"
            "  factor: 1.0e+3\n  flag: yes\n")
    assert load_yaml_mapping_text(text, "t") == yaml.safe_load(text)
    assert load_yaml_mapping_text(text, "t")["layer"]["hidden"] == 16  # an explicit key overrides a merged one
    for value in (TINY_TEXT, "[1, 2]\n", "just text\n", ""):
        assert load_yaml_mapping_text(value, "t") == yaml.safe_load(value)


# -- integer types and capacity: configs and the Python API agree -----------------------------------


def test_numpy_integers_are_accepted_as_ints():
    config = MoEConfig(**{name: np.int64(value) for name, value in VALID.items()})
    assert config == config_with()
    assert all(type(getattr(config, name)) is int for name in VALID)
    assert type(config.replace(top_k=np.int32(3)).top_k) is int
    with pytest.raises(ValueError, match="top_k=True"):
        config_with(top_k=True)


def test_python_api_accepts_numpy_integers_and_factors(seed):
    config = MoEConfig(hidden=16, ffn=24, experts=6, top_k=2, tokens_per_rank=13, seed=seed)
    router_weight, w1, w2 = make_weights(config)
    x = make_tokens(config, 0, 0)
    want = reference.moe(x, router_weight, w1, w2, top_k=2, capacity_factor=1.25)
    for top_k, factor in ((np.int64(2), np.float32(1.25)), (np.int32(2), np.float64(1.25)), (np.uint8(2), 1.25)):
        got = flashdmoe.moe(x, router_weight, w1, w2, top_k=top_k, capacity_factor=factor, backend="reference")
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    shards = [slice(0, 3), slice(3, 6)]
    xs = [x, make_tokens(config, 0, 1)]
    want = reference.moe_expert_parallel(xs, router_weight, [w1[s] for s in shards], [w2[s] for s in shards], top_k=2)
    got = flashdmoe.moe_expert_parallel(xs, router_weight, [w1[s] for s in shards], [w2[s] for s in shards],
                                        top_k=np.int64(2))
    for got_y, want_y in zip(got, want):
        torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    with pytest.raises(ValueError, match="top_k=np.True_|top_k=True"):
        flashdmoe.moe(x, router_weight, w1, w2, top_k=np.bool_(True))


@pytest.mark.parametrize("factor", [1.0e300, 1.7e308, float(2**31) * 6 / (13 * 2)])
def test_capacity_that_cannot_be_held_is_refused_naming_the_factor(factor):
    with pytest.raises(ValueError) as raised:
        config_with(tokens_per_rank=13, experts=6, top_k=2, capacity_factor=factor)
    message = str(raised.value)
    assert message.startswith(f"capacity_factor={factor!r}: keeps ceil(c * T * k / E)"), message
    assert "more than 2147483647 (2**31 - 1); a factor >= E / k = 3 already keeps every choice" in message
    config = MoEConfig(hidden=16, ffn=24, experts=6, top_k=2, tokens_per_rank=13)
    router_weight, w1, w2 = make_weights(config)
    x = make_tokens(config, 0, 0)
    with pytest.raises(ValueError, match="^" + re.escape(f"capacity_factor={factor!r}: keeps")):
        flashdmoe.moe(x, router_weight, w1, w2, top_k=2, capacity_factor=factor)
    with pytest.raises(ValueError, match="^" + re.escape(f"capacity_factor={factor!r}: keeps")):
        validate_moe_inputs(x, router_weight, w1[:3], w2[:3], top_k=2, activation="gelu", capacity_factor=factor,
                            world_size=2)
    # Just below the bound is accepted and keeps every choice, like dropless.
    largest = float(MAX_CAPACITY) * 6 / (13 * 2) * (1 - 1e-9)
    assert config_with(tokens_per_rank=13, experts=6, top_k=2, capacity_factor=largest).capacity_factor == largest
    torch.testing.assert_close(flashdmoe.moe(x, router_weight, w1, w2, top_k=2, capacity_factor=largest),
                               reference.moe(x, router_weight, w1, w2, top_k=2), rtol=0, atol=0)


def test_shipped_configs_load_with_the_documented_sizes():
    tiny = MoEConfig.from_yaml(CONFIG_DIR / "tiny.yaml")
    assert tiny.world_size > 1 and tiny.steps > 1 and tiny.dtype == "float32"
    assert tiny.tokens_per_rank * tiny.hidden * tiny.ffn * tiny.experts <= 2**24  # runs in seconds on CPU

    paper = MoEConfig.from_yaml(CONFIG_DIR / "paper.yaml")
    assert (paper.tokens_per_rank, paper.hidden, paper.ffn, paper.experts, paper.top_k) == (8192, 2048, 2048, 32, 2)
    assert (paper.world_size, paper.dtype) == (1, "bfloat16")

    node = MoEConfig.from_yaml(CONFIG_DIR / "h200x8.yaml")
    assert (node.world_size, node.experts, node.tokens_per_rank) == (8, 128, 8192)
    assert (node.hidden, node.ffn, node.top_k, node.dtype) == (2048, 2048, 2, "bfloat16")
    assert node.local_experts == 16


def test_four_gpu_config_matches_the_node_config_on_half_the_gpus():
    half = MoEConfig.from_yaml(CONFIG_DIR / "h200x4.yaml")
    node = MoEConfig.from_yaml(CONFIG_DIR / "h200x8.yaml")
    assert half.world_size == 4 and half.local_experts == 32
    assert half.replace(world_size=8) == node


def test_every_shipped_config_is_valid():
    paths = sorted(CONFIG_DIR.glob("*.yaml"))
    assert {path.name for path in paths} >= {"tiny.yaml", "paper.yaml", "h200x8.yaml"}
    for path in paths:
        assert isinstance(MoEConfig.from_yaml(path), MoEConfig)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_make_weights_shapes_dtypes_scale_and_determinism(activation, dtype):
    config = config_with(hidden=64, ffn=96, activation=activation, dtype=dtype, seed=3)
    router_weight, w1, w2 = make_weights(config)
    assert router_weight.shape == (8, 64) and router_weight.dtype == config.torch_dtype
    assert w1.shape == (8, 64, config.w1_cols) and w1.dtype == config.torch_dtype
    assert w2.shape == (8, 96, 64) and w2.dtype == config.torch_dtype
    assert all(tensor.is_contiguous() for tensor in (router_weight, w1, w2))
    # randn / sqrt(fan_in): standard deviation near 1 / sqrt(fan_in).
    assert abs(w1.float().std().item() * math.sqrt(64) - 1) < 0.05
    assert abs(w2.float().std().item() * math.sqrt(96) - 1) < 0.05
    again = make_weights(config)
    assert all(torch.equal(a, b) for a, b in zip((router_weight, w1, w2), again))
    other_seed = make_weights(config, seed=4)
    assert not torch.equal(w1, other_seed[1]) and not torch.equal(router_weight, other_seed[0])
    # Experts differ from each other (independent streams).
    assert not torch.equal(w1[0], w1[1])


def test_rank_shard_equals_slice_of_global_weights():
    config = config_with(world_size=4)
    router_weight, w1, w2 = make_weights(config)
    for rank in range(4):
        shard_router, shard_w1, shard_w2 = config.make_weights(experts=config.expert_range(rank))
        assert torch.equal(shard_router, router_weight)
        assert torch.equal(shard_w1, w1[rank * 2:(rank + 1) * 2])
        assert torch.equal(shard_w2, w2[rank * 2:(rank + 1) * 2])


def test_outputs_of_seeded_layer_are_order_one():
    from flashdmoe import reference

    config = config_with(hidden=128, ffn=256, world_size=1, tokens_per_rank=256)
    router_weight, w1, w2 = make_weights(config)
    y = reference.moe(make_tokens(config, 0, 0), router_weight, w1, w2, top_k=config.top_k)
    assert 0.1 < y.std().item() < 10


def test_make_tokens_deterministic_per_seed_rank_and_step():
    config = config_with(tokens_per_rank=32, hidden=16, dtype="float16")
    x = make_tokens(config, 1, 2)
    assert x.shape == (32, 16) and x.dtype == torch.float16
    assert torch.equal(x, config.make_tokens(1, 2))
    assert not torch.equal(x, make_tokens(config, 0, 2))
    assert not torch.equal(x, make_tokens(config, 1, 3))
    assert not torch.equal(x, make_tokens(config.replace(seed=1), 1, 2))
    assert abs(x.float().std().item() - 1) < 0.15
    assert make_tokens(config.replace(tokens_per_rank=0), 0, 0).shape == (0, 16)


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda config: make_tokens(config, 2, 0), "rank=2"),
        (lambda config: make_tokens(config, -1, 0), "rank=-1"),
        (lambda config: make_tokens(config, 0, -1), "step=-1"),
        (lambda config: make_weights(config, seed=-5), "seed=-5"),
        (lambda config: make_weights(config, experts=[8]), "index 8"),
        (lambda config: config.expert_range(5), "rank=5"),
    ],
)
def test_seeded_data_argument_errors(call, expected):
    with pytest.raises(ValueError, match=expected):
        call(config_with())
