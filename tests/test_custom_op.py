"""The registered ops (flashdmoe.ops): semantics against flashdmoe.reference, opcheck, torch.compile.

CPU: the ops' reference implementation. GPU (``@pytest.mark.gpu``): the fused kernel forward and the
expert backward, in bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from closeness import assert_normwise_close, float64_tolerance
from flashdmoe import numerics, ops, reference

ACTIVATIONS = reference.ACTIVATIONS

#: (T, H, I, E, k, activation, normalize_topk, capacity_factor, dtype): every activation, both weight
#: rules, dropless and with drops, an empty batch, the float dtypes the reference takes.
OPCHECK_CONFIGS = [
    (24, 16, 8, 4, 2, "swiglu", True, None, torch.float32),
    (24, 16, 8, 4, 2, "gelu", False, 0.5, torch.float64),
    (17, 8, 12, 6, 3, "relu", True, 0.75, torch.float32),
    (9, 8, 8, 3, 1, "silu", False, None, torch.bfloat16),
    (0, 8, 8, 4, 2, "swiglu", True, 1.0, torch.float32),
]


def make_problem(seed, tokens, hidden, intermediate, experts, activation, dtype=torch.float64, device="cpu"):
    """x [T, H], router_weight [E, H], w1 [E, H, I or 2I], w2 [E, I, H], scaled so outputs are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    columns = 2 * intermediate if activation == "swiglu" else intermediate

    def randn(*shape, fan_in):
        values = torch.randn(*shape, generator=generator, dtype=torch.float64) / math.sqrt(fan_in)
        return values.to(dtype=dtype, device=device)

    return (randn(tokens, hidden, fan_in=1), randn(experts, hidden, fan_in=hidden),
            randn(experts, hidden, columns, fan_in=hidden), randn(experts, intermediate, hidden, fan_in=intermediate))


def rows_by_loop(experts: torch.Tensor, keep: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The packed-row layout written out as a loop: expert by expert, token by token."""
    rows = torch.full(experts.shape, -1, dtype=torch.int32)
    next_row = 0
    for expert in range(num_experts):
        for token in range(experts.shape[0]):
            for choice in range(experts.shape[1]):
                if experts[token, choice] == expert and keep[token, choice]:
                    rows[token, choice] = next_row
                    next_row += 1
    return rows


# ----------------------------------------------------------------------------------------------------------
# Forward semantics
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("normalize_topk", [True, False])
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_forward_is_the_reference(seed, activation, normalize_topk, capacity_factor):
    T, H, I, E, k = 30, 16, 12, 5, 2
    x, router_weight, w1, w2 = make_problem(seed, T, H, I, E, activation, dtype=torch.float32)
    y, expert, weight, row, counts = torch.ops.flashdmoe.moe_forward(
        x, router_weight, w1, w2, k, activation, normalize_topk, capacity_factor)
    want = reference.moe(x, router_weight, w1, w2, top_k=k, activation=activation, normalize_topk=normalize_topk,
                         capacity_factor=capacity_factor)
    assert torch.equal(y, want)  # the same reference functions on the same choices
    routing = reference.route(x, router_weight, k, normalize_topk)
    keep = reference.keep_mask(routing.experts, E, reference.expert_capacity(T, k, E, capacity_factor))
    assert expert.dtype == torch.int32 and torch.equal(expert.long(), routing.experts)
    assert weight.dtype == torch.float32 and torch.equal(weight, routing.weights)
    assert counts.dtype == torch.int32
    assert torch.equal(counts.long(), torch.bincount(routing.experts.reshape(-1), minlength=E))
    assert row.dtype == torch.int32 and torch.equal(row, rows_by_loop(routing.experts, keep, E))
    assert (capacity_factor is None) == bool((row >= 0).all())


def test_packed_rows_layout(seed):
    """Kept choices of each expert occupy one contiguous segment, experts in order, tokens in order."""
    generator = torch.Generator().manual_seed(seed)
    T, E, k = 40, 7, 3
    experts = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(T)])
    keep = reference.keep_mask(experts, E, capacity=5)
    rows = ops.packed_rows(experts, keep, E)
    assert torch.equal(rows, rows_by_loop(experts, keep, E))
    kept = rows[rows >= 0].sort().values
    assert torch.equal(kept, torch.arange(int(keep.sum()), dtype=torch.int32))


def test_routing_outputs_are_not_differentiable(seed):
    x, router_weight, w1, w2 = (t.requires_grad_() for t in make_problem(seed, 6, 8, 8, 4, "gelu"))
    y, expert, weight, row, counts = torch.ops.flashdmoe.moe_forward(x, router_weight, w1, w2, 2)
    assert y.requires_grad
    assert not any(t.requires_grad for t in (expert, weight, row, counts))


def test_y_only_op_and_python_entry_point(seed):
    x, router_weight, w1, w2 = make_problem(seed, 20, 8, 8, 4, "swiglu")
    want, want_aux = reference.moe(x, router_weight, w1, w2, top_k=2, activation="swiglu", capacity_factor=0.5,
                                   return_aux=True)
    assert torch.equal(torch.ops.flashdmoe.moe(x, router_weight, w1, w2, 2, "swiglu", True, 0.5), want)
    y, aux = ops.moe(x, router_weight, w1, w2, top_k=2, activation="swiglu", capacity_factor=0.5, return_aux=True)
    assert torch.equal(y, want)
    assert torch.equal(aux.counts, want_aux.counts) and aux.counts.dtype == torch.int64
    assert int(aux.dropped) == int(want_aux.dropped) > 0
    # the same sums in another order (bincount vs one-hot counts): E + T terms in float64
    assert_normwise_close(aux.aux_loss, want_aux.aux_loss, float64_tolerance(20, depth=2), "aux_loss")


@pytest.mark.parametrize(("change", "argument"), [
    (lambda a: {**a, "w2": a["w2"][:, :-1]}, "w2"),
    (lambda a: {**a, "router_weight": a["router_weight"][:, :-1]}, "router_weight"),
    (lambda a: {**a, "w1": a["w1"].float()}, "w1"),
    (lambda a: {**a, "top_k": 0}, "top_k"),
    (lambda a: {**a, "activation": "tanh"}, "activation"),
    (lambda a: {**a, "capacity_factor": -1.0}, "capacity_factor"),
])
def test_bad_input_names_the_argument(seed, change, argument):
    x, router_weight, w1, w2 = make_problem(seed, 5, 8, 8, 4, "gelu")
    arguments = change(dict(x=x, router_weight=router_weight, w1=w1, w2=w2, top_k=2, activation="gelu",
                            capacity_factor=None))
    with pytest.raises(ValueError, match=argument):
        ops.moe(arguments.pop("x"), arguments.pop("router_weight"), arguments.pop("w1"), arguments.pop("w2"),
                **arguments)


def test_any_strides_are_accepted(seed):
    """A transposed weight view (a Hugging Face expert layout) gives the same result as its dense copy."""
    x, router_weight, w1, w2 = make_problem(seed, 12, 8, 6, 4, "swiglu")
    w1_view, w2_view = w1.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert not w1_view.is_contiguous()
    got = ops.moe(x, router_weight, w1_view, w2_view, top_k=2, activation="swiglu")
    # a strided GEMM may block its sums otherwise: the two expert GEMMs and the combine, H or 2I terms
    assert_normwise_close(got, ops.moe(x, router_weight, w1, w2, top_k=2, activation="swiglu"),
                          float64_tolerance(2 * 6, depth=3), "y")


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("normalize_topk", [True, False])
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_backward_matches_autograd_of_the_reference(seed, activation, normalize_topk, capacity_factor):
    T, H, I, E, k = 30, 16, 12, 5, 2
    inputs = [t.requires_grad_() for t in make_problem(seed, T, H, I, E, activation)]
    options = dict(top_k=k, activation=activation, normalize_topk=normalize_topk, capacity_factor=capacity_factor)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    got = torch.autograd.grad(ops.moe(*inputs, **options), inputs, dy)
    want = torch.autograd.grad(reference.moe(*inputs, **options), inputs, dy)
    # the chain rule written out against autograd's: float64, reductions over T, H, 2I or E terms, the
    # forward recomputation (3 chained reductions) plus the backward's (3)
    tolerance = float64_tolerance(max(T, H, 2 * I, E), depth=6)
    for name, g, w in zip(("dx", "d_router_weight", "dw1", "dw2"), got, want):
        assert_normwise_close(g, w, tolerance, name)


def test_gradcheck(seed):
    inputs = [t.requires_grad_() for t in make_problem(seed, 10, 6, 5, 4, "swiglu")]
    assert torch.autograd.gradcheck(
        lambda *a: ops.moe(*a, top_k=2, activation="swiglu", capacity_factor=0.8), inputs)


def test_only_the_needed_gradients_are_computed(seed):
    x, router_weight, w1, w2 = make_problem(seed, 12, 8, 8, 4, "gelu")
    w1.requires_grad_()
    out = torch.ops.flashdmoe.moe_forward(x, router_weight, w1, w2, 2)
    dy = torch.ones_like(out[0])
    dx, d_router, dw1, dw2 = torch.ops.flashdmoe.moe_backward(dy, x, router_weight, w1.detach(), w2, *out[1:4],
                                                              "gelu", True, [False, False, True, False])
    assert dx.numel() == d_router.numel() == dw2.numel() == 0 and dw1.shape == w1.shape
    (want,) = torch.autograd.grad(reference.moe(x, router_weight, w1, w2, top_k=2), [w1], dy)
    assert_normwise_close(dw1, want, float64_tolerance(12, depth=6), "dw1")
    (through_autograd,) = torch.autograd.grad(out[0], [w1], dy)
    assert torch.equal(through_autograd, dw1)


# ----------------------------------------------------------------------------------------------------------
# opcheck and torch.compile on CPU
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", OPCHECK_CONFIGS,
                         ids=lambda c: f"T{c[0]}-{c[5]}-k{c[4]}-cap{c[7]}-{str(c[8]).removeprefix('torch.')}")
def test_opcheck_cpu(seed, config):
    T, H, I, E, k, activation, normalize_topk, capacity_factor, dtype = config
    inputs = [t.requires_grad_() for t in make_problem(seed, T, H, I, E, activation, dtype=dtype)]
    torch.library.opcheck(torch.ops.flashdmoe.moe_forward.default,
                          (*inputs, k, activation, normalize_topk, capacity_factor))
    _, expert, weight, row, _ = torch.ops.flashdmoe.moe_forward(*inputs, k, activation, normalize_topk,
                                                                capacity_factor)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    detached = [t.detach() for t in inputs]
    for needs in ([True, True, True, True], [False, True, False, True]):
        torch.library.opcheck(torch.ops.flashdmoe.moe_backward.default,
                              (dy, *detached, expert, weight, row, activation, normalize_topk, needs))
    torch.library.opcheck(torch.ops.flashdmoe.moe.default, (*inputs, k, activation, normalize_topk, capacity_factor))


class _MoEBlock(nn.Module):
    """A residual block around the op, as a model would hold it."""

    def __init__(self, generator, hidden, intermediate, experts, top_k, activation, capacity_factor, dtype):
        super().__init__()
        columns = 2 * intermediate if activation == "swiglu" else intermediate
        self.top_k, self.activation, self.capacity_factor = top_k, activation, capacity_factor
        self.router_weight = nn.Parameter((torch.randn(experts, hidden, generator=generator) / hidden ** 0.5).to(dtype))
        self.w1 = nn.Parameter((torch.randn(experts, hidden, columns, generator=generator) / hidden ** 0.5).to(dtype))
        self.w2 = nn.Parameter((torch.randn(experts, intermediate, hidden, generator=generator)
                                / intermediate ** 0.5).to(dtype))

    def forward(self, h):
        return h + ops.moe(h, self.router_weight, self.w1, self.w2, top_k=self.top_k, activation=self.activation,
                           capacity_factor=self.capacity_factor)


class _TinyModel(nn.Module):
    """embedding -> 2 MoE blocks -> head."""

    def __init__(self, seed, *, vocab=48, hidden=16, intermediate=24, experts=4, top_k=2, activation="swiglu",
                 capacity_factor=1.0, dtype=torch.float32):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embedding = nn.Embedding(vocab, hidden, dtype=dtype)
        nn.init.normal_(self.embedding.weight, generator=generator)
        self.blocks = nn.ModuleList(_MoEBlock(generator, hidden, intermediate, experts, top_k, activation,
                                              capacity_factor, dtype) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, dtype=dtype)
        nn.init.normal_(self.head.weight, std=hidden ** -0.5, generator=generator)

    def forward(self, tokens):
        h = self.embedding(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_compile_fullgraph_cpu(seed):
    """embedding -> [MoE block calling the op] x2 -> head compiles without a graph break and computes
    what eager computes, gradients included."""
    torch._dynamo.reset()
    model = _TinyModel(seed)
    T, H, I, V = 32, 16, 24, 48
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, V, (T,), generator=generator)
    dlogits = torch.randn(T, V, generator=generator)
    outputs = {}
    for name, run in (("eager", model), ("compiled", torch.compile(model, fullgraph=True))):
        model.zero_grad(set_to_none=True)
        logits = run(tokens)
        logits.backward(dlogits)
        outputs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (eager, eager_grads), (compiled, compiled_grads) = outputs["eager"], outputs["compiled"]
    # The op runs the same implementation on the same inputs in both (the embedding gather and the
    # residual adds are exact), so the MoE outputs agree bit for bit; only the head may sum in another
    # order: one reduction of H terms.
    assert_normwise_close(compiled, eager, numerics.reorder_tolerance(torch.float32, H), "logits")
    # Backward: the head's (T or V terms), the op's backward carrying dy's reordering through its three
    # chained reductions per block (H, 2I or E terms), the embedding's scatter-add (T terms).
    tolerance = numerics.reorder_tolerance(torch.float32, max(T, H, 2 * I, V), depth=2 + 3 * 2)
    for name, grad in eager_grads.items():
        assert_normwise_close(compiled_grads[name], grad, tolerance, f"grad of {name}")


# ----------------------------------------------------------------------------------------------------------
# GPU: the fused kernel forward and the expert backward, bfloat16
# ----------------------------------------------------------------------------------------------------------

GPU_CONFIGS = [
    (256, 128, 128, 8, 2, "swiglu", True, None),
    (200, 128, 64, 16, 4, "gelu", False, 1.0),
    (64, 64, 128, 4, 1, "relu", True, 0.5),
]


def _gpu_ready():
    from flashdmoe.kernel import extension

    extension.load()  # a build failure on the GPU machine is a failure, not a skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: f"T{c[0]}-{c[5]}-k{c[4]}-cap{c[7]}")
def test_opcheck_cuda_bf16(seed, config):
    _gpu_ready()
    T, H, I, E, k, activation, normalize_topk, capacity_factor = config
    inputs = [t.requires_grad_() for t in make_problem(seed, T, H, I, E, activation, dtype=torch.bfloat16,
                                                       device="cuda")]
    torch.library.opcheck(torch.ops.flashdmoe.moe_forward.default,
                          (*inputs, k, activation, normalize_topk, capacity_factor))
    _, expert, weight, row, _ = torch.ops.flashdmoe.moe_forward(*inputs, k, activation, normalize_topk,
                                                                capacity_factor)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.flashdmoe.moe_backward.default,
                          (dy, *[t.detach() for t in inputs], expert, weight, row, activation, normalize_topk,
                           [True, True, True, True]))


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: f"T{c[0]}-{c[5]}-k{c[4]}-cap{c[7]}")
def test_cuda_forward_is_the_kernel_and_rows_match_the_cpu_layout(seed, config):
    _gpu_ready()
    from flashdmoe import cuda_backend

    T, H, I, E, k, activation, normalize_topk, capacity_factor = config
    inputs = make_problem(seed, T, H, I, E, activation, dtype=torch.bfloat16, device="cuda")
    y, expert, weight, row, counts = torch.ops.flashdmoe.moe_forward(*inputs, k, activation, normalize_topk,
                                                                     capacity_factor)
    want_y, routing = cuda_backend.fused_forward(*inputs, top_k=k, activation=activation,
                                                 normalize_topk=normalize_topk, capacity_factor=capacity_factor)
    assert torch.equal(y, want_y) and torch.equal(expert, routing.expert) and torch.equal(row, routing.row)
    assert torch.equal(weight, routing.weight) and torch.equal(counts, routing.counts)
    # The CPU implementation's packing, applied to the kernel's own choices, is the kernel's row table.
    assert torch.equal(ops.packed_rows(expert.cpu(), row.cpu() >= 0, E), row.cpu())


@pytest.mark.gpu
def test_compile_fullgraph_cuda_bf16(seed):
    _gpu_ready()
    torch._dynamo.reset()
    T, H, I, V = 128, 128, 128, 256
    model = _TinyModel(seed, vocab=V, hidden=H, intermediate=I, experts=8, dtype=torch.bfloat16).cuda()
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, V, (T,), generator=generator).cuda()
    dlogits = torch.randn(T, V, generator=generator).to(device="cuda", dtype=torch.bfloat16)
    outputs = {}
    for name, run in (("eager", model), ("compiled", torch.compile(model, fullgraph=True))):
        model.zero_grad(set_to_none=True)
        logits = run(tokens)
        logits.backward(dlogits)
        outputs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (eager, eager_grads), (compiled, compiled_grads) = outputs["eager"], outputs["compiled"]
    # The op's inputs are bitwise equal on both paths (an exact gather and single-rounding residual adds),
    # so the kernel computes the same; the head may round its result once differently.
    assert_normwise_close(compiled, eager, numerics.rounding_tolerance(torch.bfloat16, 1), "logits")
    # Backward: dy may differ by the head's rounding, and each block's backward and the embedding's
    # scatter-add may round once more per result: 2 + 2 * blocks roundings.
    tolerance = numerics.rounding_tolerance(torch.bfloat16, 2 + 2 * 2)
    for name, grad in eager_grads.items():
        assert_normwise_close(compiled_grads[name], grad, tolerance, f"grad of {name}")


def test_moe_layer_compiles_fullgraph_through_the_op(seed):
    """What users call: flashdmoe.MoELayer inside a model, torch.compile(fullgraph=True): the public API
    switches to the registered op while tracing, with eager's results."""
    import flashdmoe

    torch._dynamo.reset()
    torch.manual_seed(seed)
    config = flashdmoe.MoEConfig(hidden=16, ffn=24, experts=4, top_k=2, tokens_per_rank=32, activation="gelu",
                                 capacity_factor=1.0, dtype="float32", world_size=1, seed=seed % 1000)
    model = nn.Sequential(nn.Linear(16, 16), flashdmoe.MoELayer(config), nn.Linear(16, 16))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed))
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    # the same reference arithmetic in both; the Linear layers may sum in another order (16 terms)
    assert_normwise_close(compiled, eager, numerics.reorder_tolerance(torch.float32, 16, depth=3), "y")
