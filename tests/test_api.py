"""flashdmoe.moe: input validation, backend choice, and MoELayer against the reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import flashdmoe
from flashdmoe import api, numerics, reference
from flashdmoe.config import MoEConfig, make_weights
from flashdmoe.errors import BackendUnavailable
from flashdmoe.validation import ACTIVATIONS, MoESizes, validate_moe_inputs

T, H, I, E, K = 6, 8, 12, 4, 2


def random_inputs(seed: int = 0, *, tokens: int = T, experts: int = E, local_experts: int | None = None,
                  activation: str = "gelu", dtype: torch.dtype = torch.float32):
    """Fresh random x [T, H], router_weight [E, H], w1 [L, H, I or 2I], w2 [L, I, H]."""
    generator = torch.Generator().manual_seed(seed)
    local_experts = experts if local_experts is None else local_experts
    columns = 2 * I if activation == "swiglu" else I

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    return (randn(tokens, H), randn(experts, H, scale=H ** -0.5),
            randn(local_experts, H, columns, scale=H ** -0.5), randn(local_experts, I, H, scale=I ** -0.5))


def with_nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[2, 3] = math.nan
    return x


def with_inf(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0] = -math.inf
    return x


# Each case: (name, function of the four valid tensors -> changed call arguments, expected text).
# The expected text starts with the argument's name, as the error must.
BAD_INPUTS = [
    ("x not a tensor", lambda x, r, w1, w2: dict(x=x.tolist()), "x: expected a torch.Tensor, got list"),
    ("router not a tensor", lambda x, r, w1, w2: dict(router_weight=r.numpy()), "router_weight: expected a torch.Tensor"),
    ("x 3-D", lambda x, r, w1, w2: dict(x=x[None]), "x: expected a 2-D tensor, got shape [1, 6, 8]"),
    ("x 1-D", lambda x, r, w1, w2: dict(x=x[0]), "x: expected a 2-D tensor"),
    ("w1 2-D", lambda x, r, w1, w2: dict(w1=w1[0]), "w1: expected a 3-D tensor"),
    ("w2 4-D", lambda x, r, w1, w2: dict(w2=w2[None]), "w2: expected a 3-D tensor"),
    ("router 3-D", lambda x, r, w1, w2: dict(router_weight=r[None]), "router_weight: expected a 2-D tensor"),
    ("x integer", lambda x, r, w1, w2: dict(x=x.long()), "x: dtype torch.int64 is not supported"),
    ("w2 complex", lambda x, r, w1, w2: dict(w2=w2.to(torch.complex64)), "w2: dtype torch.complex64 is not supported"),
    ("w1 dtype differs", lambda x, r, w1, w2: dict(w1=w1.half()), "w1: dtype torch.float16 differs from x's dtype torch.float32"),
    ("router dtype differs", lambda x, r, w1, w2: dict(router_weight=r.double()), "router_weight: dtype torch.float64 differs"),
    ("w2 other device", lambda x, r, w1, w2: dict(w2=w2.to("meta")), "w2: on device meta but x is on cpu"),
    ("w1 not contiguous", lambda x, r, w1, w2: dict(w1=w1.transpose(1, 2).contiguous().transpose(1, 2)),
     "w1: tensor of shape [4, 8, 12] is not contiguous"),
    ("x not contiguous", lambda x, r, w1, w2: dict(x=torch.randn(H, T).t()), "x: tensor of shape [6, 8] is not contiguous"),
    ("activation unknown", lambda x, r, w1, w2: dict(activation="tanh"), "activation='tanh': expected one of relu, gelu"),
    ("activation not str", lambda x, r, w1, w2: dict(activation=None), "activation=None"),
    ("capacity zero", lambda x, r, w1, w2: dict(capacity_factor=0.0), "capacity_factor=0.0: expected None"),
    ("capacity negative", lambda x, r, w1, w2: dict(capacity_factor=-1), "capacity_factor=-1"),
    ("capacity nan", lambda x, r, w1, w2: dict(capacity_factor=math.nan), "capacity_factor=nan"),
    ("capacity string", lambda x, r, w1, w2: dict(capacity_factor="1.0"), "capacity_factor='1.0'"),
    ("router hidden mismatch", lambda x, r, w1, w2: dict(router_weight=torch.randn(E, H + 1)),
     "router_weight: shape [4, 9] does not match x [6, 8]; expected [E, 8]"),
    ("x hidden zero", lambda x, r, w1, w2: dict(x=torch.randn(T, 0)), "x: shape [6, 0] has hidden size 0"),
    ("router no experts", lambda x, r, w1, w2: dict(router_weight=torch.randn(0, H)), "router_weight: shape [0, 8] has no experts"),
    ("w1 expert count", lambda x, r, w1, w2: dict(w1=w1[:3].contiguous()), "w1: shape [3, 8, 12] holds 3 experts; expected L"),
    ("w1 hidden mismatch", lambda x, r, w1, w2: dict(w1=torch.randn(E, H + 2, I)), "w1: shape [4, 10, 12] does not match hidden size 8"),
    ("w2 ffn mismatch", lambda x, r, w1, w2: dict(w2=torch.randn(E, I + 1, H)), "w2: shape [4, 13, 8] does not match"),
    ("w2 hidden mismatch", lambda x, r, w1, w2: dict(w2=torch.randn(E, I, H + 1)), "expected [L, I, H] = [4, 12, 8]"),
    ("w2 expert count", lambda x, r, w1, w2: dict(w2=w2[:2].contiguous()), "w2: shape [2, 12, 8]"),
    ("swiglu odd columns", lambda x, r, w1, w2: dict(activation="swiglu", w1=torch.randn(E, H, 2 * I + 1)),
     "w1: shape [4, 8, 25] has 25 columns; swiglu expects [L, H, 2I]"),
    ("swiglu w2 not half", lambda x, r, w1, w2: dict(activation="swiglu", w1=torch.randn(E, H, 2 * I), w2=torch.randn(E, 2 * I, H)),
     "w2: shape [4, 24, 8]"),
    ("top_k zero", lambda x, r, w1, w2: dict(top_k=0), "top_k=0: expected an integer with 1 <= top_k <= E = 4"),
    ("top_k above E", lambda x, r, w1, w2: dict(top_k=5), "top_k=5"),
    ("top_k float", lambda x, r, w1, w2: dict(top_k=2.0), "top_k=2.0"),
    ("top_k bool", lambda x, r, w1, w2: dict(top_k=True), "top_k=True"),
    ("x has NaN", lambda x, r, w1, w2: dict(x=with_nan(x)), "x: contains 1 non-finite value(s)"),
    ("x has Inf", lambda x, r, w1, w2: dict(x=with_inf(x)), "x: contains 1 non-finite value(s)"),
]


def call_arguments(changes: dict) -> dict:
    x, router_weight, w1, w2 = random_inputs()
    arguments = dict(x=x, router_weight=router_weight, w1=w1, w2=w2, top_k=K, activation="gelu", capacity_factor=None)
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize("name, change, expected", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_validate_moe_inputs_names_the_argument(name, change, expected):
    arguments = call_arguments(change(*random_inputs()))
    with pytest.raises(ValueError) as raised:
        validate_moe_inputs(**arguments)
    assert expected in str(raised.value)


@pytest.mark.parametrize("name, change, expected", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_moe_rejects_bad_inputs_before_any_backend(name, change, expected):
    arguments = call_arguments(change(*random_inputs()))
    x, router_weight, w1, w2 = (arguments.pop(key) for key in ("x", "router_weight", "w1", "w2"))
    with pytest.raises(ValueError) as raised:
        flashdmoe.moe(x, router_weight, w1, w2, backend="reference", **arguments)
    assert expected in str(raised.value)


@pytest.mark.parametrize(
    "world_size, local_experts, expected",
    [
        (3, 4, "router_weight: 4 experts cannot be split over world_size=3 ranks"),
        (2, 4, "w1: shape [4, 8, 12] holds 4 experts; expected L = E / world_size = 4 / 2 = 2"),
        (0, 4, "world_size=0: expected an integer >= 1"),
    ],
)
def test_validate_expert_parallel_shapes(world_size, local_experts, expected):
    x, router_weight, w1, w2 = random_inputs(local_experts=local_experts)
    with pytest.raises(ValueError) as raised:
        validate_moe_inputs(x, router_weight, w1, w2, top_k=K, activation="relu", capacity_factor=None,
                            world_size=world_size)
    assert expected in str(raised.value)


def test_validate_returns_sizes():
    x, router_weight, w1, w2 = random_inputs(local_experts=2, activation="swiglu")
    sizes = validate_moe_inputs(x, router_weight, w1, w2, top_k=3, activation="swiglu", capacity_factor=1.5,
                                world_size=2)
    assert sizes == MoESizes(tokens=T, hidden=H, ffn=I, experts=E, top_k=3, local_experts=2, world_size=2)


def test_validate_accepts_zero_tokens_and_every_supported_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x, router_weight, w1, w2 = random_inputs(tokens=0, dtype=dtype)
        assert validate_moe_inputs(x, router_weight, w1, w2, top_k=K, activation="silu",
                                   capacity_factor=None).tokens == 0


def test_activation_list_matches_reference():
    assert ACTIVATIONS == tuple(reference.ACTIVATIONS)


# -- backend choice ------------------------------------------------------------------------------


def test_auto_on_cpu_runs_the_reference():
    x, router_weight, w1, w2 = random_inputs(seed=1)
    assert api.resolve_backend(x, "auto") == "reference"
    y = flashdmoe.moe(x, router_weight, w1, w2, top_k=K, activation="silu", capacity_factor=1.0)
    expected = reference.moe(x, router_weight, w1, w2, top_k=K, activation="silu", capacity_factor=1.0)
    assert y.shape == (T, H) and y.dtype == x.dtype
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_cuda_backend_on_cpu_tensors_says_why():
    x, router_weight, w1, w2 = random_inputs(seed=2)
    with pytest.raises(BackendUnavailable, match="backend='cuda' is unavailable: tensors are on cpu"):
        flashdmoe.moe(x, router_weight, w1, w2, top_k=K, backend="cuda")


@pytest.mark.parametrize("backend", ["triton", "", None, "CUDA"])
def test_unknown_backend_is_a_value_error(backend):
    x, router_weight, w1, w2 = random_inputs(seed=3)
    with pytest.raises(ValueError, match="backend=.*expected one of auto, reference, cuda"):
        flashdmoe.moe(x, router_weight, w1, w2, top_k=K, backend=backend)


def test_multi_rank_team_on_reference_points_to_expert_parallel():
    x, router_weight, w1, w2 = random_inputs(seed=4, local_experts=2)
    team = SimpleNamespace(rank=0, world_size=2)
    for backend in ("auto", "reference"):
        with pytest.raises(ValueError, match="moe_expert_parallel"):
            flashdmoe.moe(x, router_weight, w1, w2, top_k=K, team=team, backend=backend)


@pytest.mark.parametrize("team", [SimpleNamespace(rank=0, world_size=0), SimpleNamespace(rank=0), "two"])
def test_malformed_team_is_rejected(team):
    x, router_weight, w1, w2 = random_inputs(seed=5)
    with pytest.raises(ValueError, match="team: expected None or a flashdmoe.Team"):
        flashdmoe.moe(x, router_weight, w1, w2, top_k=K, team=team)


def test_single_rank_team_runs_the_reference():
    x, router_weight, w1, w2 = random_inputs(seed=6)
    y = flashdmoe.moe(x, router_weight, w1, w2, top_k=K, team=SimpleNamespace(rank=0, world_size=1))
    torch.testing.assert_close(y, reference.moe(x, router_weight, w1, w2, top_k=K), rtol=0, atol=0)


def test_backend_choice_follows_cuda_availability(monkeypatch):
    x = random_inputs(seed=7)[0]
    monkeypatch.setattr(api, "cuda_unavailable_reason", lambda tensor: None)
    assert api.resolve_backend(x, "auto") == "cuda"
    assert api.resolve_backend(x, "cuda") == "cuda"
    assert api.resolve_backend(x, "reference") == "reference"
    monkeypatch.setattr(api, "cuda_unavailable_reason", lambda tensor: "nvcc was not found")
    assert api.resolve_backend(x, "auto") == "reference"
    with pytest.raises(BackendUnavailable, match="nvcc was not found"):
        api.resolve_backend(x, "cuda")


def test_cuda_backend_receives_the_contract_arguments(monkeypatch):
    from flashdmoe import cuda_backend

    x, router_weight, w1, w2 = random_inputs(seed=8, activation="swiglu")
    team = SimpleNamespace(rank=0, world_size=1)
    calls = []

    def fake_moe_cuda(*args, **kwargs):
        calls.append((args, kwargs))
        return "fused result"

    monkeypatch.setattr(api, "cuda_unavailable_reason", lambda tensor: None)
    monkeypatch.setattr(cuda_backend, "moe_cuda", fake_moe_cuda)
    result = flashdmoe.moe(x, router_weight, w1, w2, top_k=3, activation="swiglu", normalize_topk=False,
                           capacity_factor=1.25, team=team, backend="cuda", return_aux=True)
    assert result == "fused result"
    (args, kwargs), = calls
    assert all(got is want for got, want in zip(args, (x, router_weight, w1, w2)))
    assert kwargs == dict(top_k=3, activation="swiglu", normalize_topk=False, capacity_factor=1.25,
                          return_aux=True, team=team)


def test_cuda_unavailable_reason_on_cpu():
    assert "tensors are on cpu" in api.cuda_unavailable_reason(torch.randn(2, 3))


@pytest.mark.parametrize("flag", ["normalize_topk", "return_aux"])
def test_boolean_flags_must_be_bool(flag):
    x, router_weight, w1, w2 = random_inputs(seed=9)
    with pytest.raises(ValueError, match=f"{flag}=1: expected True or False"):
        flashdmoe.moe(x, router_weight, w1, w2, top_k=K, **{flag: 1})


def test_return_aux_matches_reference():
    x, router_weight, w1, w2 = random_inputs(seed=10, tokens=40)
    y, aux = flashdmoe.moe(x, router_weight, w1, w2, top_k=K, capacity_factor=0.5, return_aux=True)
    want_y, want_aux = reference.moe(x, router_weight, w1, w2, top_k=K, capacity_factor=0.5, return_aux=True)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    assert torch.equal(aux.counts, want_aux.counts) and int(aux.counts.sum()) == 40 * K
    assert int(aux.dropped) == int(want_aux.dropped) > 0
    torch.testing.assert_close(aux.aux_loss, want_aux.aux_loss)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_on_cuda_matches_reference(dtype):
    # H and I are multiples of 64, which the fused kernel needs; auto picks it when it is built.
    config = MoEConfig(hidden=128, ffn=192, experts=8, top_k=2, tokens_per_rank=300, seed=11,
                       dtype=str(dtype).removeprefix("torch."))
    router_weight, w1, w2 = make_weights(config, device="cuda")
    x = config.make_tokens(0, 0, device="cuda")
    chosen = api.resolve_backend(x, "auto")
    assert chosen == ("cuda" if api.cuda_unavailable_reason(x) is None else "reference")
    y = flashdmoe.moe(x, router_weight, w1, w2, top_k=2)
    expected = reference.moe(x, router_weight, w1, w2, top_k=2)
    assert y.dtype == dtype and y.is_cuda
    scale = float(expected.float().abs().max())
    assert float((y.float() - expected.float()).abs().max()) <= numerics.kernel_tolerance(dtype) * scale


# -- MoELayer ------------------------------------------------------------------------------------


LAYER_CASES = [
    dict(activation="gelu"),
    dict(activation="swiglu", capacity_factor=0.75),
    dict(activation="relu", normalize_topk=False, top_k=1),
    dict(activation="silu", top_k=3, capacity_factor=2.0),
]


@pytest.mark.parametrize("options", LAYER_CASES, ids=[case["activation"] for case in LAYER_CASES])
def test_layer_forward_backward_equals_reference(options):
    config = MoEConfig(**{"hidden": 16, "ffn": 24, "experts": 6, "top_k": 2, "tokens_per_rank": 37, "seed": 5,
                          **options})
    layer = flashdmoe.MoELayer(config)
    assert layer.backend == "auto"
    router_weight, w1, w2 = (tensor.requires_grad_() for tensor in make_weights(config))
    assert layer.router_weight.shape == (6, 16) and layer.w1.shape == (6, 16, config.w1_cols)
    assert layer.w2.shape == (6, 24, 16)

    generator = torch.Generator().manual_seed(17)
    x = torch.randn(37, 16, generator=generator)
    output_grad = torch.randn(37, 16, generator=generator)
    x_layer, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()

    y = layer(x_layer)
    expected = reference.moe(x_reference, router_weight, w1, w2, top_k=config.top_k, activation=config.activation,
                             normalize_topk=config.normalize_topk, capacity_factor=config.capacity_factor)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)  # the layer calls the same reference ops
    y.backward(output_grad)
    expected.backward(output_grad)
    for got, want in [(x_layer.grad, x_reference.grad), (layer.router_weight.grad, router_weight.grad),
                      (layer.w1.grad, w1.grad), (layer.w2.grad, w2.grad)]:
        assert got is not None and float(got.abs().max()) > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_layer_return_aux_and_backend_attribute():
    config = MoEConfig(hidden=8, ffn=8, experts=4, top_k=2, tokens_per_rank=10, capacity_factor=0.5)
    layer = flashdmoe.MoELayer(config)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    layer.backend = "reference"
    y, aux = layer(x, return_aux=True)
    assert y.shape == (10, 8) and aux.counts.shape == (4,) and int(aux.counts.sum()) == 20
    layer.backend = "bogus"
    with pytest.raises(ValueError, match="backend='bogus'"):
        layer(x)
    layer.backend = "cuda"
    with pytest.raises(BackendUnavailable, match="tensors are on cpu"):
        layer(x)


def test_layer_holds_its_rank_shard_and_resets():
    config = MoEConfig(hidden=8, ffn=12, experts=6, top_k=2, tokens_per_rank=4, world_size=3, seed=9)
    router_weight, w1, w2 = make_weights(config)
    layer = flashdmoe.MoELayer(config, team=SimpleNamespace(rank=2, world_size=3))
    assert torch.equal(layer.router_weight.detach(), router_weight)
    assert torch.equal(layer.w1.detach(), w1[4:6]) and torch.equal(layer.w2.detach(), w2[4:6])
    with torch.no_grad():
        layer.w1.mul_(3)
    layer.reset_parameters()
    assert torch.equal(layer.w1.detach(), w1[4:6])
    assert "rank=2/3" in repr(layer)
    # The reference runs one rank per call; the layer says where the multi-rank reference is.
    with pytest.raises(ValueError, match="moe_expert_parallel"):
        layer(torch.randn(4, 8))


def test_layer_team_must_match_config():
    multi_rank = MoEConfig(hidden=8, ffn=8, experts=4, top_k=2, tokens_per_rank=4, world_size=2)
    with pytest.raises(ValueError, match="team=None means one rank, but config.world_size=2"):
        flashdmoe.MoELayer(multi_rank)
    with pytest.raises(ValueError, match="team: world_size=4 does not match config.world_size=2"):
        flashdmoe.MoELayer(multi_rank, team=SimpleNamespace(rank=0, world_size=4))
    with pytest.raises(ValueError, match="config: expected a flashdmoe.MoEConfig"):
        flashdmoe.MoELayer({"hidden": 8})


def test_layer_bfloat16_parameters():
    config = MoEConfig(hidden=16, ffn=16, experts=4, top_k=2, tokens_per_rank=8, dtype="bfloat16")
    layer = flashdmoe.MoELayer(config)
    assert {parameter.dtype for parameter in layer.parameters()} == {torch.bfloat16}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = layer(x)
    y = y.detach()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all() and float(y.abs().max()) > 0


def test_readme_python_example_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S)
    assert example, "README.md has no python example"
    namespace: dict = {}
    exec(compile(example.group(1), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["y"].shape == (namespace["T"], namespace["H"])
    assert namespace["layer"].router_weight.grad is not None


# ---- moe_expert_parallel (all ranks from one process) ----

def _ep_inputs(P=2, L=2, H=16, I=8, tokens=(5, 0), seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g) for T in tokens]
    router = torch.randn(P * L, H, generator=g)
    w1s = [torch.randn(L, H, I, generator=g) for _ in range(P)]
    w2s = [torch.randn(L, I, H, generator=g) for _ in range(P)]
    return xs, router, w1s, w2s


def test_moe_expert_parallel_without_team_is_the_reference():
    xs, router, w1s, w2s = _ep_inputs(tokens=(7, 3))
    got = flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=2, capacity_factor=1.0)
    want = reference.moe_expert_parallel(xs, router, w1s, w2s, top_k=2, capacity_factor=1.0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_moe_expert_parallel_rejects_mismatched_lists():
    xs, router, w1s, w2s = _ep_inputs()
    with pytest.raises(ValueError, match="xs, w1s, w2s"):
        flashdmoe.moe_expert_parallel(xs, router, w1s[:1], w2s, top_k=2)
    with pytest.raises(ValueError, match="expected lists"):
        flashdmoe.moe_expert_parallel(xs[0], router, w1s, w2s, top_k=2)


def test_moe_expert_parallel_checks_each_rank():
    xs, router, w1s, w2s = _ep_inputs()
    w2s[1] = w2s[1][:, :, :8]
    with pytest.raises(ValueError, match="w2"):
        flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=2)


def test_moe_expert_parallel_kernel_path_needs_an_emulated_team():
    xs, router, w1s, w2s = _ep_inputs()
    with pytest.raises(ValueError, match="Team.emulated"):
        flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=2, backend="cuda")
    with pytest.raises(ValueError, match="world_size"):
        flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=2, team=flashdmoe.Team.single())
