"""Tests of the oracle, flashdmoe.reference: hand-worked numbers, gradients, capacity, aux, expert parallel."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from closeness import assert_normwise_close, float64_tolerance
from flashdmoe import numerics, reference
from flashdmoe.reference import ACTIVATIONS

LN2, LN3, LN4 = math.log(2.0), math.log(3.0), math.log(4.0)


def random_problem(tokens, hidden, intermediate, experts, activation, *, dtype=torch.float64, seed=0):
    """Fresh random x [T,H], router_weight [E,H], w1 [E,H,I or 2I], w2 [E,I,H], scaled so outputs are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    w1_cols = 2 * intermediate if activation == "swiglu" else intermediate

    def randn(*shape, fan_in):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)

    x = randn(tokens, hidden, fan_in=1)
    router_weight = randn(experts, hidden, fan_in=hidden)
    w1 = randn(experts, hidden, w1_cols, fan_in=hidden)
    w2 = randn(experts, intermediate, hidden, fan_in=intermediate)
    return x, router_weight, w1, w2


# --------------------------------------------------------------------------------------------------------
# A tiny example worked out by hand: T=2, H=2, E=3, k=2, I=2, relu
# --------------------------------------------------------------------------------------------------------
#   x[0] = [1, 0], x[1] = [0, 1];  router rows r0 = [ln4, ln3], r1 = [ln2, 0], r2 = [0, 0]
#   logits[0] = [ln4, ln2, 0] -> exp = [4, 2, 1] -> p = [4/7, 2/7, 1/7] -> experts (0, 1)
#   logits[1] = [ln3, 0, 0]   -> exp = [3, 1, 1] -> p = [3/5, 1/5, 1/5] -> experts (0, 1):
#       experts 1 and 2 tie exactly (both logits are exactly 0); the tie goes to the lower index, 1.
#   Experts (relu):
#     W1_0 = [[1, -1], [2, 1]],  W2_0 = [[1, 0], [0, 1]]
#       FFN_0(x0) = relu([1, -1]) @ W2_0 = [1, 0] ;  FFN_0(x1) = relu([2, 1]) @ W2_0 = [2, 1]
#     W1_1 = [[-1, 1], [1, 0]],  W2_1 = [[2, 0], [1, 3]]
#       FFN_1(x0) = relu([-1, 1]) @ W2_1 = [0, 1] @ W2_1 = [1, 3] ;  FFN_1(x1) = [1, 0] @ W2_1 = [2, 0]
#     W1_2 = [[3, 0], [0, 3]],   W2_2 = [[1, 1], [1, 1]]
#       FFN_2(x1) = [0, 3] @ W2_2 = [3, 3]   (what a wrong tie break would mix in)
HAND_X = [[1.0, 0.0], [0.0, 1.0]]
HAND_ROUTER = [[LN4, LN3], [LN2, 0.0], [0.0, 0.0]]
HAND_W1 = [[[1.0, -1.0], [2.0, 1.0]], [[-1.0, 1.0], [1.0, 0.0]], [[3.0, 0.0], [0.0, 3.0]]]
HAND_W2 = [[[1.0, 0.0], [0.0, 1.0]], [[2.0, 0.0], [1.0, 3.0]], [[1.0, 1.0], [1.0, 1.0]]]


def hand_problem(dtype):
    return tuple(torch.tensor(values, dtype=dtype) for values in (HAND_X, HAND_ROUTER, HAND_W1, HAND_W2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_worked_routing(dtype):
    x, router_weight, _, _ = hand_problem(dtype)
    routing = reference.route(x, router_weight, top_k=2, normalize_topk=True)
    # a softmax of three values and the renormalisation: at most eight roundings on values <= 1
    tolerance = dict(rtol=0, atol=numerics.rounding_tolerance(dtype, 8))
    expected_probs = torch.tensor([[4 / 7, 2 / 7, 1 / 7], [3 / 5, 1 / 5, 1 / 5]], dtype=dtype)
    torch.testing.assert_close(routing.probs, expected_probs, **tolerance)
    assert routing.probs[1, 1] == routing.probs[1, 2]  # the tie really is exact
    assert routing.experts.dtype == torch.int64
    assert routing.experts.tolist() == [[0, 1], [0, 1]]
    # normalised: (4/7, 2/7) / (6/7) = (2/3, 1/3);  (3/5, 1/5) / (4/5) = (3/4, 1/4)
    expected_weights = torch.tensor([[2 / 3, 1 / 3], [3 / 4, 1 / 4]], dtype=dtype)
    torch.testing.assert_close(routing.weights, expected_weights, **tolerance)
    raw = reference.route(x, router_weight, top_k=2, normalize_topk=False)
    torch.testing.assert_close(raw.weights, torch.tensor([[4 / 7, 2 / 7], [3 / 5, 1 / 5]], dtype=dtype), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_worked_output(dtype):
    x, router_weight, w1, w2 = hand_problem(dtype)
    # the routing's eight roundings, then relu(x @ w1) @ w2 and the weighted sum: a dozen more, on values <= 2
    tolerance = dict(rtol=0, atol=2 * numerics.rounding_tolerance(dtype, 20))
    # y0 = 2/3 * [1, 0] + 1/3 * [1, 3] = [1, 1];   y1 = 3/4 * [2, 1] + 1/4 * [2, 0] = [2, 0.75]
    y = reference.moe(x, router_weight, w1, w2, top_k=2, activation="relu")
    assert y.dtype == dtype and y.shape == (2, 2)
    torch.testing.assert_close(y, torch.tensor([[1.0, 1.0], [2.0, 0.75]], dtype=dtype), **tolerance)
    # not normalised: y0 = 4/7 * [1, 0] + 2/7 * [1, 3] = [6/7, 6/7];  y1 = 3/5 * [2, 1] + 1/5 * [2, 0] = [1.6, 0.6]
    y_raw = reference.moe(x, router_weight, w1, w2, top_k=2, activation="relu", normalize_topk=False)
    torch.testing.assert_close(y_raw, torch.tensor([[6 / 7, 6 / 7], [1.6, 0.6]], dtype=dtype), **tolerance)


def test_hand_worked_aux():
    x, router_weight, w1, w2 = hand_problem(torch.float64)
    _, aux = reference.moe(x, router_weight, w1, w2, top_k=2, activation="relu", return_aux=True)
    # both tokens chose experts 0 and 1: counts [2, 2, 0], f = counts / (T*k = 4) = [1/2, 1/2, 0]
    assert aux.counts.dtype == torch.int64 and aux.counts.tolist() == [2, 2, 0]
    assert aux.dropped.dtype == torch.int64 and aux.dropped.dim() == 0 and int(aux.dropped) == 0
    # mean p = [(4/7 + 3/5)/2, (2/7 + 1/5)/2, (1/7 + 1/5)/2] = [41/70, 17/70, 12/70]
    # aux = E * sum f * mean p = 3 * (41/140 + 17/140) = 87/70
    assert aux.aux_loss.dim() == 0 and aux.aux_loss.dtype == torch.float64
    assert aux.aux_loss.item() == pytest.approx(87 / 70, abs=2 * numerics.rounding_tolerance(torch.float64, 20))


def test_hand_worked_capacity():
    x, router_weight, w1, w2 = hand_problem(torch.float64)
    # capacity = ceil(0.5 * T=2 * k=2 / E=3) = ceil(0.667) = 1: token 0 keeps its slots in experts 0 and 1,
    # token 1 loses both choices -> y1 = 0, and y0 is unchanged (no renormalisation).
    assert reference.expert_capacity(2, 2, 3, 0.5) == 1
    y, aux = reference.moe(x, router_weight, w1, w2, top_k=2, activation="relu", capacity_factor=0.5, return_aux=True)
    torch.testing.assert_close(y, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64), rtol=0,
                               atol=2 * numerics.rounding_tolerance(torch.float64, 20))
    assert int(aux.dropped) == 2 and aux.counts.tolist() == [2, 2, 0]


# --------------------------------------------------------------------------------------------------------
# Ties, dtypes, k = E, T = 0, input checks
# --------------------------------------------------------------------------------------------------------


def test_ties_go_to_lower_index():
    # equal probabilities everywhere: the first k indices, in order
    probs = torch.full((3, 8), 1 / 8)
    assert reference.top_k_experts(probs, 3).tolist() == [[0, 1, 2]] * 3
    # a tie at the k-th place between a low and a high index, placed so a reversed scan would pick the high one
    probs = torch.tensor([[0.1, 0.2, 0.05, 0.4, 0.05, 0.2], [0.3, 0.0, 0.3, 0.0, 0.3, 0.1]])
    assert reference.top_k_experts(probs, 2).tolist() == [[3, 1], [0, 2]]
    assert reference.top_k_experts(probs, 3).tolist() == [[3, 1, 5], [0, 2, 4]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_computes_in_float32(dtype):
    x, router_weight, w1, w2 = random_problem(6, 8, 5, 4, "gelu", dtype=dtype, seed=1)
    y = reference.moe(x, router_weight, w1, w2, top_k=2, activation="gelu")
    assert y.dtype == dtype
    routing = reference.route(x, router_weight, 2)
    assert routing.probs.dtype == torch.float32 and routing.weights.dtype == torch.float32
    # storage dtype only: the same values upcast to float32 give the same result before the final cast
    upcast = reference.moe(x.float(), router_weight.float(), w1.float(), w2.float(), top_k=2, activation="gelu")
    assert torch.equal(y, upcast.to(dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_top_k_equal_to_experts_is_probability_weighted_sum(activation):
    x, router_weight, w1, w2 = random_problem(5, 6, 4, 4, activation, seed=2)
    y = reference.moe(x, router_weight, w1, w2, top_k=4, activation=activation)
    probs = torch.softmax(x @ router_weight.T, dim=-1)
    expected = sum(probs[:, e, None] * reference.expert_ffn(x, w1[e], w2[e], activation) for e in range(4))
    assert_normwise_close(y, expected, float64_tolerance(6, depth=4))


def test_activations_match_their_definitions():
    generator = torch.Generator().manual_seed(3)
    v = torch.randn(7, 4, generator=generator, dtype=torch.float64)
    w1 = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    w2 = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    w1_half = w1[:, :3]
    pre = v @ w1_half
    definitions = {
        "relu": pre.clamp(min=0),
        "gelu": 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2))),
        "silu": pre * torch.sigmoid(pre),
    }
    for activation, hidden in definitions.items():
        result = reference.expert_ffn(v, w1_half, w2, activation)
        assert_normwise_close(result, hidden @ w2, float64_tolerance(4, depth=2), activation)
    gate, up = v @ w1[:, :3], v @ w1[:, 3:]
    swiglu = (gate * torch.sigmoid(gate) * up) @ w2
    assert_normwise_close(reference.expert_ffn(v, w1, w2, "swiglu"), swiglu, float64_tolerance(4, depth=2), "swiglu")


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_zero_tokens(capacity_factor):
    x, router_weight, w1, w2 = random_problem(0, 6, 4, 4, "silu", seed=4)
    tensors = [t.requires_grad_() for t in (x, router_weight, w1, w2)]
    y, aux = reference.moe(*tensors, top_k=2, activation="silu", capacity_factor=capacity_factor, return_aux=True)
    assert y.shape == (0, 6) and y.dtype == torch.float64
    assert aux.counts.tolist() == [0, 0, 0, 0] and int(aux.dropped) == 0 and aux.aux_loss.item() == 0.0
    grads = torch.autograd.grad(y.sum() + aux.aux_loss, tensors)
    assert grads[0].shape == (0, 6)
    assert all(torch.count_nonzero(grad) == 0 for grad in grads[1:])


def test_bad_arguments_raise_value_error():
    x, router_weight, w1, w2 = random_problem(3, 6, 4, 4, "gelu")
    with pytest.raises(ValueError, match="activation='tanh'"):
        reference.moe(x, router_weight, w1, w2, top_k=2, activation="tanh")
    with pytest.raises(ValueError, match="top_k=5"):
        reference.moe(x, router_weight, w1, w2, top_k=5)
    with pytest.raises(ValueError, match="top_k=0"):
        reference.route(x, router_weight, 0)
    with pytest.raises(ValueError, match="w1 has shape"):
        reference.moe(x, router_weight, w1, w2, top_k=2, activation="swiglu")
    with pytest.raises(ValueError, match="capacity_factor=0"):
        reference.expert_capacity(3, 2, 4, 0)
    with pytest.raises(ValueError, match="router_weight has 4 experts"):
        reference.moe_expert_parallel([x, x, x], router_weight, [w1[:1]] * 3, [w2[:1]] * 3, top_k=2)


# --------------------------------------------------------------------------------------------------------
# Capacity on a constructed routing
# --------------------------------------------------------------------------------------------------------

# T=6, E=4, k=2. Router = identity (H = E) and x[t] = 5 * onehot(first) + 4 * onehot(second): token t chooses
# exactly (first, second), in that order.
CAPACITY_ROUTES = [(0, 1), (0, 2), (1, 0), (0, 3), (2, 1), (1, 0)]
# capacity = ceil(1.0 * 6 * 2 / 4) = 3, in token order:
#   expert 0 is chosen by t0, t1, t2, t3, t5 -> keeps t0, t1, t2; drops t3 (j=0) and t5 (j=1)
#   expert 1 is chosen by t0, t2, t4, t5     -> keeps t0, t2, t4; drops t5 (j=0)
#   expert 2 by t1, t4 and expert 3 by t3    -> all kept
CAPACITY_KEEP = [[True, True], [True, True], [True, True], [False, True], [True, True], [False, False]]


def capacity_problem(activation="relu"):
    x = torch.zeros(6, 4, dtype=torch.float64)
    for token, (first, second) in enumerate(CAPACITY_ROUTES):
        x[token, first], x[token, second] = 5.0, 4.0
    x += 0.01 * torch.rand(6, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # < the gap 1
    _, _, w1, w2 = random_problem(1, 4, 3, 4, activation, seed=6)
    return x, torch.eye(4, dtype=torch.float64), w1, w2


def test_keep_mask_token_order():
    experts = torch.tensor(CAPACITY_ROUTES)
    assert reference.expert_capacity(6, 2, 4, 1.0) == 3
    assert reference.keep_mask(experts, 4, 3).tolist() == CAPACITY_KEEP
    assert reference.keep_mask(experts, 4, None).all()
    # capacity 1: only the first choice of each expert survives: e0 <- t0, e1 <- t0, e2 <- t1, e3 <- t3
    assert reference.keep_mask(experts, 4, 1).tolist() == [
        [True, True], [False, True], [False, False], [False, True], [False, False], [False, False]
    ]


def test_capacity_drops_exactly_and_without_renormalisation():
    x, router_weight, w1, w2 = capacity_problem()
    routing = reference.route(x, router_weight, top_k=2)
    assert routing.experts.tolist() == [list(pair) for pair in CAPACITY_ROUTES]
    y, aux = reference.moe(x, router_weight, w1, w2, top_k=2, activation="relu", capacity_factor=1.0, return_aux=True)
    assert aux.counts.tolist() == [5, 4, 2, 1]  # before capacity
    assert int(aux.dropped) == 3
    for token, (first, second) in enumerate(CAPACITY_ROUTES):
        expected = torch.zeros(4, dtype=torch.float64)
        for j, expert in enumerate((first, second)):
            if CAPACITY_KEEP[token][j]:  # original (not renormalised) weight of the kept choice
                ffn = F.relu(x[token] @ w1[expert]) @ w2[expert]
                expected += routing.weights[token, j] * ffn
        assert_normwise_close(y[token], expected, float64_tolerance(4, depth=3), f"token {token}")
    assert torch.count_nonzero(y[5]) == 0
    # dropless: every choice contributes
    y_dropless = reference.moe(x, router_weight, w1, w2, top_k=2, activation="relu")
    assert torch.equal(y_dropless[:3], y[:3]) and not torch.allclose(y_dropless[3], y[3])


def test_capacity_rounds_up():
    assert reference.expert_capacity(10, 2, 4, 1.1) == 6  # ceil(5.5)
    assert reference.expert_capacity(8, 2, 4, 1.0) == 4
    assert reference.expert_capacity(0, 2, 4, 2.0) == 0
    assert reference.expert_capacity(8, 2, 4, None) is None


# --------------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------------


def top_k_margin(x, router_weight, top_k):
    """Smallest gap between the k-th and (k+1)-th probability over tokens (inf when k = E)."""
    probs = torch.softmax(x @ router_weight.T, dim=-1).sort(dim=-1, descending=True).values
    if top_k == probs.shape[1]:
        return math.inf
    return (probs[:, top_k - 1] - probs[:, top_k]).min().item()


# Central differences in float64 with step eps: truncation ~eps^2 |f'''|/6 and rounding ~u |f| / eps
# (u = 2^-53), both ~1e-10 for these O(1) layers; 1000x that leaves room for |f'''| and |f| up to ~100.
_EPS = 1e-6
GRADCHECK = dict(eps=_EPS, atol=1000 * (_EPS ** 2 + numerics.precision(torch.float64).unit_roundoff / _EPS), rtol=1e-5)


@pytest.mark.parametrize("normalize_topk", [True, False])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck(activation, normalize_topk):
    x, router_weight, w1, w2 = random_problem(4, 3, 3, 4, activation, seed=7)
    # gradcheck perturbs by 1e-6: the routing must not flip and relu must stay away from its kink
    assert top_k_margin(x, router_weight, 2) > 1e-3
    assert (torch.einsum("th,ehi->tei", x, w1).abs() > 1e-4).all()
    inputs = tuple(t.requires_grad_() for t in (x, router_weight, w1, w2))

    def layer(*tensors):
        y, aux = reference.moe(
            *tensors, top_k=2, activation=activation, normalize_topk=normalize_topk, return_aux=True
        )
        return y, aux.aux_loss

    assert torch.autograd.gradcheck(layer, inputs, **GRADCHECK)


def test_gradcheck_with_capacity():
    x, router_weight, w1, w2 = random_problem(6, 3, 3, 4, "gelu", seed=8)
    assert top_k_margin(x, router_weight, 2) > 1e-3
    _, aux = reference.moe(x, router_weight, w1, w2, top_k=2, capacity_factor=0.5, return_aux=True)
    assert int(aux.dropped) > 0  # the capacity is really in play
    inputs = tuple(t.requires_grad_() for t in (x, router_weight, w1, w2))
    assert torch.autograd.gradcheck(
        lambda *t: reference.moe(*t, top_k=2, capacity_factor=0.5), inputs, **GRADCHECK
    )


@pytest.mark.parametrize("normalize_topk", [True, False])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fixed_routing_matches_moe(activation, normalize_topk):
    x, router_weight, w1, w2 = random_problem(9, 6, 5, 8, activation, seed=9)
    inputs = [t.requires_grad_() for t in (x, router_weight, w1, w2)]
    options = dict(activation=activation, normalize_topk=normalize_topk)
    y = reference.moe(*inputs, top_k=3, capacity_factor=0.7, **options)
    routing = reference.route(x, router_weight, 3, normalize_topk)
    keep = reference.keep_mask(routing.experts, 8, reference.expert_capacity(9, 3, 8, 0.7))
    assert not keep.all()
    y_fixed = reference.moe_fixed_routing(*inputs, routing.experts, keep, **options)
    assert torch.equal(y, y_fixed)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(10), dtype=y.dtype)
    grads = torch.autograd.grad(y, inputs, upstream)
    grads_fixed = torch.autograd.grad(y_fixed, inputs, upstream)
    for grad, grad_fixed in zip(grads, grads_fixed):
        assert_normwise_close(grad_fixed, grad, float64_tolerance(9, depth=6))
    assert grads[1].abs().sum() > 0  # the router gets a gradient through the probabilities


# --------------------------------------------------------------------------------------------------------
# Expert parallel
# --------------------------------------------------------------------------------------------------------

TOKEN_COUNTS = {1: [[7], [0]], 2: [[5, 0], [3, 9], [0, 0]], 4: [[6, 0, 3, 11], [0, 0, 0, 4]]}
EP_CASES = [(world, counts) for world, cases in TOKEN_COUNTS.items() for counts in cases]


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("world_size,token_counts", EP_CASES)
def test_expert_parallel_matches_moe(world_size, token_counts, activation, capacity_factor):
    experts, top_k = 8, 2
    x, router_weight, w1, w2 = random_problem(sum(token_counts), 6, 5, experts, activation, seed=11)
    xs = list(x.split(token_counts))
    w1s, w2s = list(w1.chunk(world_size)), list(w2.chunk(world_size))
    options = dict(top_k=top_k, activation=activation, capacity_factor=capacity_factor)
    ys, auxes = reference.moe_expert_parallel(xs, router_weight, w1s, w2s, return_aux=True, **options)
    assert [y.shape for y in ys] == [(count, 6) for count in token_counts]
    # capacity is per source rank, so compare rank by rank with the single-rank reference on all experts
    for x_rank, y_rank, aux_rank in zip(xs, ys, auxes):
        expected, expected_aux = reference.moe(x_rank, router_weight, w1, w2, return_aux=True, **options)
        assert_normwise_close(y_rank, expected, float64_tolerance(8, depth=3), "y")
        assert torch.equal(aux_rank.counts, expected_aux.counts)
        assert torch.equal(aux_rank.dropped, expected_aux.dropped)
        assert_normwise_close(aux_rank.aux_loss, expected_aux.aux_loss, float64_tolerance(max(token_counts + [8]), depth=3), "aux")
    if capacity_factor is None:  # dropless: also one call on the concatenated batch, split back
        expected_all = reference.moe(x, router_weight, w1, w2, **options).split(token_counts)
        for y_rank, expected in zip(ys, expected_all):
            assert_normwise_close(y_rank, expected, float64_tolerance(8, depth=3), "y (one batch)")


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_expert_parallel_gradients(capacity_factor):
    world_size, token_counts = 4, [5, 0, 2, 7]
    x, router_weight, w1, w2 = random_problem(sum(token_counts), 6, 5, 8, "swiglu", seed=12)
    xs = [t.requires_grad_() for t in x.split(token_counts)]
    w1s = [t.requires_grad_() for t in w1.chunk(world_size)]
    w2s = [t.requires_grad_() for t in w2.chunk(world_size)]
    router_parallel = router_weight.clone().requires_grad_()
    options = dict(top_k=2, activation="swiglu", capacity_factor=capacity_factor)
    ys = reference.moe_expert_parallel(xs, router_parallel, w1s, w2s, **options)
    upstream = [torch.randn(y.shape, generator=torch.Generator().manual_seed(13 + r), dtype=y.dtype)
                for r, y in enumerate(ys)]
    grads_parallel = torch.autograd.grad(ys, [*xs, router_parallel, *w1s, *w2s], upstream)

    x_single = [t.detach().clone().requires_grad_() for t in xs]
    router_single, w1_single, w2_single = (t.detach().clone().requires_grad_() for t in (router_weight, w1, w2))
    ys_single = [reference.moe(x_rank, router_single, w1_single, w2_single, **options) for x_rank in x_single]
    grads_single = torch.autograd.grad(ys_single, [*x_single, router_single, w1_single, w2_single], upstream)

    expected = [*grads_single[:world_size], grads_single[world_size],
                *grads_single[world_size + 1].chunk(world_size), *grads_single[world_size + 2].chunk(world_size)]
    for got, want in zip(grads_parallel, expected, strict=True):
        assert_normwise_close(got, want, float64_tolerance(sum(token_counts), depth=6))


# --------------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_matches_cpu(activation):
    x, router_weight, w1, w2 = random_problem(33, 16, 24, 8, activation, dtype=torch.float32, seed=14)
    assert top_k_margin(x.double(), router_weight.double(), 2) > 1e-3  # same routing on both devices
    cpu_inputs = [t.requires_grad_() for t in (x, router_weight, w1, w2)]
    cuda_inputs = [t.detach().cuda().requires_grad_() for t in cpu_inputs]
    options = dict(top_k=2, activation=activation, capacity_factor=1.0, return_aux=True)
    y_cpu, aux_cpu = reference.moe(*cpu_inputs, **options)
    y_cuda, aux_cuda = reference.moe(*cuda_inputs, **options)
    assert y_cuda.device.type == "cuda"
    # float32 on both devices (no TF32: torch's matmul default), other blockings: reductions of <= 24 terms
    assert_normwise_close(y_cuda.cpu(), y_cpu, numerics.reorder_tolerance(torch.float32, 24, depth=3), "y")
    assert torch.equal(aux_cuda.counts.cpu(), aux_cpu.counts)
    grads_cpu = torch.autograd.grad(y_cpu.square().sum(), cpu_inputs)
    grads_cuda = torch.autograd.grad(y_cuda.square().sum(), cuda_inputs)
    for got, want in zip(grads_cuda, grads_cpu):
        assert_normwise_close(got.cpu(), want, numerics.reorder_tolerance(torch.float32, 33, depth=6), "gradient")
