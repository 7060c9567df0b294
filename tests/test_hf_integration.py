"""flashdmoe.integrations.transformers.patch_moe against the unmodified transformers models.

Small randomly initialised models of each supported family (``from_config``, nothing downloaded): logits,
greedy generation and a training step's gradients of the patched model against a deep copy left as
transformers wrote it. CPU: the reference backend in float32. GPU (``@pytest.mark.gpu``): the fused kernel.

Tolerances (normwise relative, flashdmoe.numerics). On CPU in float32 the patched block computes what the
original computes, in the same dtype, with other summation orders: per MoE block three chained reductions
(GEMM1 over H, GEMM2 over I, the combine over k), so the logits differ by at most
``reorder_tolerance(float32, max(H, I), depth=3 * blocks)``; the layers between the blocks compute the same
operations on the perturbed residual stream and carry its relative error forward. A training step adds the
backward's three chained reductions per block (over H, 2I, E or T terms): ``depth=6 * blocks`` over
``max(H, 2I, E, T)``.

Near-ties: a routing or a greedy choice whose margin is below what these errors can move would make two
correct implementations disagree. Each test draws prompts from its seed until the unmodified model's
routing (every MoE block, every forward of the generation) and its greedy choices all clear twice the
bound on the error of the compared quantity; see :func:`_clear_prompt`.
"""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import transformers  # a test dependency (the test extras install it): missing fails, never skips

from closeness import assert_normwise_close  # noqa: E402
from flashdmoe import numerics  # noqa: E402
from flashdmoe.errors import BackendUnavailable  # noqa: E402
from flashdmoe.integrations import transformers as hf  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, EXPERTS, LAYERS = 128, 64, 64, 8, 2
BATCH, PROMPT, NEW_TOKENS = 2, 8, 8
ATTEMPTS = 20  # prompts drawn before a test gives up on finding one without near-ties


def _transformers_class(name: str):
    """A transformers class the installed release may lack (families newer than 5.0): skip the case then."""
    found = getattr(transformers, name, None)
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return found


def _config(family: str, *, layers: int = LAYERS, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE):
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, pad_token_id=0,
                  bos_token_id=None)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=intermediate, num_local_experts=EXPERTS,
                                          num_experts_per_tok=2)
    if family == "qwen2_moe":  # shared expert, no renormalisation
        return transformers.Qwen2MoeConfig(**common, intermediate_size=intermediate,
                                           moe_intermediate_size=intermediate,
                                           shared_expert_intermediate_size=intermediate, num_experts=EXPERTS,
                                           num_experts_per_tok=4, norm_topk_prob=False)
    if family in ("qwen3_moe", "qwen3_moe-plain"):
        return transformers.Qwen3MoeConfig(**common, intermediate_size=intermediate,
                                           moe_intermediate_size=intermediate, num_experts=EXPERTS,
                                           num_experts_per_tok=4, head_dim=16,
                                           norm_topk_prob=family == "qwen3_moe")
    if family == "qwen3_next":  # shared expert, renormalised; full attention only (the MoE block is what counts)
        config = _transformers_class("Qwen3NextConfig")
        return config(**common, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                      shared_expert_intermediate_size=intermediate, num_experts=EXPERTS, num_experts_per_tok=4,
                      norm_topk_prob=True, head_dim=16, layer_types=["full_attention"] * layers,
                      decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen3_5_moe":  # shared expert, always renormalised
        config = _transformers_class("Qwen3_5MoeTextConfig")
        return config(**common, moe_intermediate_size=intermediate, shared_expert_intermediate_size=intermediate,
                      num_experts=EXPERTS, num_experts_per_tok=4, head_dim=16, layer_types=["full_attention"] * layers)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=intermediate, num_experts=EXPERTS,
                                        num_experts_per_tok=2, norm_topk_prob=False)
    if family == "flex_olmo":
        config = _transformers_class("FlexOlmoConfig")
        return config(**common, intermediate_size=intermediate, num_experts=EXPERTS, num_experts_per_tok=2,
                      norm_topk_prob=False)
    if family == "minimax":  # always renormalised; full attention only
        config = _transformers_class("MiniMaxConfig")
        return config(**common, intermediate_size=intermediate, num_local_experts=EXPERTS, num_experts_per_tok=2,
                      head_dim=16, layer_types=["full_attention"] * layers)
    if family.startswith("cohere2_moe"):  # softmax over the top-k logits; shared experts averaged or summed in
        config = _transformers_class("Cohere2MoeConfig")
        return config(**common, intermediate_size=intermediate, num_experts=EXPERTS, num_experts_per_tok=2,
                      head_dim=16, layer_types=["full_attention"] * layers, num_shared_experts=1,
                      shared_expert_combination_strategy="sum" if family == "cohere2_moe-sum" else "average")
    if family in ("granitemoe", "granitemoeshared", "granitemoehybrid"):  # softmax over the top-k logits
        config = _transformers_class({"granitemoe": "GraniteMoeConfig", "granitemoeshared": "GraniteMoeSharedConfig",
                                      "granitemoehybrid": "GraniteMoeHybridConfig"}[family])
        extra = {} if family == "granitemoe" else {"shared_intermediate_size": intermediate}
        if family == "granitemoehybrid":
            extra["layer_types"] = ["attention"] * layers  # no Mamba layers
        return config(**common, intermediate_size=intermediate, num_local_experts=EXPERTS, num_experts_per_tok=2,
                      **extra)
    raise AssertionError(family)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe-plain", "qwen3_next", "qwen3_5_moe", "olmoe", "flex_olmo",
            "minimax", "granitemoe", "granitemoeshared", "granitemoehybrid", "cohere2_moe", "cohere2_moe-sum"]
BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
          "qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen3_moe-plain": "Qwen3MoeSparseMoeBlock",
          "qwen3_next": "Qwen3NextSparseMoeBlock", "qwen3_5_moe": "Qwen3_5MoeSparseMoeBlock",
          "olmoe": "OlmoeSparseMoeBlock", "flex_olmo": "FlexOlmoSparseMoeBlock", "minimax": "MiniMaxSparseMoeBlock",
          "granitemoe": "GraniteMoeMoE", "granitemoeshared": "GraniteMoeSharedMoE",
          "granitemoehybrid": "GraniteMoeHybridMoE", "cohere2_moe": "Cohere2MoeSparseMoeBlock",
          "cohere2_moe-sum": "Cohere2MoeSparseMoeBlock"}


def _block_attr(family: str) -> str:
    """The decoder layer's name for its MoE block."""
    return "block_sparse_moe" if family.startswith("granite") else "mlp"


def _model(family: str, seed: int, **sizes) -> nn.Module:
    torch.manual_seed(seed)  # from_config initialises from the global generator
    return transformers.AutoModelForCausalLM.from_config(_config(family, **sizes)).eval()


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hf._family_of(m) is not None]


# ----------------------------------------------------------------------------------------------------------
# Prompts without near-ties
# ----------------------------------------------------------------------------------------------------------


def _routing_clear(model: nn.Module, run, margin_at):
    """Run ``run()`` on the unmodified ``model``; returns (whether every token of every forward of every MoE
    block has its k-th and (k+1)-th router logits further apart than ``margin_at(block index, x [T, H],
    router weight [E, H])`` (per token), ``run()``'s result). The router's own input is looked at, after
    anything the block does first (Mixtral's training jitter)."""
    clear = [True]
    handles = []
    for index, block in enumerate(_moe_blocks(model)):
        def look(router, args, index=index):
            x = args[0].reshape(-1, args[0].shape[-1]).detach().double()
            weight = router.weight.detach().double()
            k = router.top_k
            if k < weight.shape[0]:
                top = (x @ weight.T).topk(k + 1, dim=-1).values
                clear[0] &= bool((top[:, k - 1] - top[:, k] > margin_at(index, x, weight)).all())
        handles.append(block._modules[hf._family_of(block).router_attr].register_forward_pre_hook(look))
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    return clear[0], result


def _clear_prompt(model: nn.Module, seed: int, *, router_margin, logits_tolerance: float, device="cpu"):
    """A prompt ``[BATCH, PROMPT]`` drawn from ``seed`` whose greedy generation by the unmodified model has
    no near-tie: every routing margin exceeds ``router_margin`` and every step's top-1 logit leads the
    runner-up by more than ``2 * logits_tolerance * ||that step's logits||`` (the most two models
    agreeing to ``logits_tolerance`` can disagree on a difference). Returns (prompt, greedy sequences)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(ATTEMPTS):
        prompt = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=generator).to(device)
        routing_ok, out = _routing_clear(model, lambda: model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=0), router_margin)
        scores = torch.stack(out.scores).double()  # [steps, B, V]
        top = scores.topk(2, dim=-1).values
        choices_ok = bool((top[..., 0] - top[..., 1] > 2 * logits_tolerance * scores.norm(dim=-1)).all())
        if routing_ok and choices_ok:
            return prompt, out.sequences
    pytest.fail(f"no prompt among {ATTEMPTS} drawn from seed {seed} is free of near-ties; the margins are "
                "set by the tolerances, which this test does not tune")


def _cpu_logits_tolerance(blocks: int) -> float:
    return numerics.reorder_tolerance(torch.float32, max(HIDDEN, INTERMEDIATE), depth=3 * blocks)


def _cpu_router_margin(index: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Twice the bound on a router logit's error in block ``index``: its input carries the error of the
    ``index`` blocks before it (3 reductions each), plus its own dot product over H: ``|dl| <= tolerance *
    ||x_t|| * ||w_e||``."""
    tolerance = numerics.reorder_tolerance(torch.float32, max(HIDDEN, INTERMEDIATE), depth=3 * index + 1)
    return 2 * tolerance * x.norm(dim=1) * weight.norm(dim=1).max()


# ----------------------------------------------------------------------------------------------------------
# Versions
# ----------------------------------------------------------------------------------------------------------


def test_installed_version_is_the_pinned_range():
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    (pin,) = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["hf"]
              if Requirement(r).name == "transformers"]
    assert pin.specifier == Requirement("transformers" + hf.SUPPORTED_TRANSFORMERS).specifier
    assert hf.check_transformers_version() == transformers.__version__
    assert transformers.__version__ in pin.specifier


@pytest.mark.parametrize("version", ["4.57.6", "6.0.0"])
def test_unsupported_version_fails_clearly(monkeypatch, version):
    model = _model("mixtral", 0)
    # the module patch_moe will import (transformers may re-register its lazy module while building a model)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(ImportError, match=rf"transformers {version} is installed.*supports transformers>=5\.0,<6"):
        hf.patch_moe(model)


# ----------------------------------------------------------------------------------------------------------
# Supported families on CPU
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_kept_not_copied(seed, family):
    model = _model(family, seed)
    originals = dict(model.named_parameters())
    keys = list(model.state_dict())
    replaced = hf.patch_moe(model)
    assert replaced == [f"model.layers.{i}.{_block_attr(family)}" for i in range(LAYERS)]
    assert list(model.state_dict()) == keys
    assert all(parameter is originals[name] for name, parameter in model.named_parameters())
    for name in replaced:
        block = model.get_submodule(name)
        assert isinstance(block, hf.FlashDMoEBlock) and block.replaced == BLOCKS[family] and not block.kernel
        # CPU: no re-layout, the views read the parameters' own storage
        assert block.experts.gate_up_proj.is_contiguous() and block.experts.down_proj.is_contiguous()
    assert hf.patch_moe(model) == []  # patching again finds nothing left to replace


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match(seed, family):
    model = _model(family, seed)
    patched = copy.deepcopy(model)
    hf.patch_moe(patched)
    tolerance = _cpu_logits_tolerance(LAYERS)
    prompt, _ = _clear_prompt(model, seed, router_margin=_cpu_router_margin, logits_tolerance=tolerance)
    with torch.no_grad():
        want, got = model(prompt, output_router_logits=True), patched(prompt, output_router_logits=True)
    assert_normwise_close(got.logits, want.logits, tolerance, "logits")
    # transformers still records the router logits (its hooks see the original gate run), on inputs that
    # differ as the blocks' outputs before them do
    assert len(got.router_logits) == len(want.router_logits) == LAYERS
    for index, (got_layer, want_layer) in enumerate(zip(got.router_logits, want.router_logits)):
        assert_normwise_close(got_layer, want_layer, _cpu_logits_tolerance(index) if index else 0.0,
                              f"router logits of layer {index}")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches(seed, family):
    model = _model(family, seed)
    patched = copy.deepcopy(model)
    hf.patch_moe(patched)
    prompt, want = _clear_prompt(model, seed, router_margin=_cpu_router_margin,
                                 logits_tolerance=_cpu_logits_tolerance(LAYERS))
    got = patched.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.shape == (BATCH, PROMPT + NEW_TOKENS)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_match(seed, family):
    model = _model(family, seed)
    patched = copy.deepcopy(model)
    hf.patch_moe(patched)
    prompt, _ = _clear_prompt(model, seed, router_margin=_cpu_router_margin,
                              logits_tolerance=_cpu_logits_tolerance(LAYERS))
    grads = []
    for run in (model, patched):
        run.train()
        out = run(prompt, labels=prompt, output_router_logits=True)  # the loss includes the router's aux loss
        out.loss.backward()
        grads.append({name: p.grad for name, p in run.named_parameters()})
    want, got = grads
    assert want.keys() == got.keys()
    tolerance = numerics.reorder_tolerance(torch.float32, max(HIDDEN, 2 * INTERMEDIATE, EXPERTS, BATCH * PROMPT),
                                           depth=6 * LAYERS)
    for name, grad in want.items():
        assert (grad is None) == (got[name] is None), name
        if grad is not None:
            assert_normwise_close(got[name], grad, tolerance, f"grad of {name}")


def test_patched_model_compiles_without_graph_breaks(seed):
    """The patched blocks trace into one graph with the rest of the model (the op's fake implementation),
    and a patched model still copies and pickles."""
    torch._dynamo.reset()
    model = _model("qwen2_moe", seed)
    hf.patch_moe(model)
    prompt, _ = _clear_prompt(model, seed, router_margin=_cpu_router_margin,
                              logits_tolerance=_cpu_logits_tolerance(LAYERS))
    # aot_eager: the traced graph runs the same ATen operations as eager, so this checks the tracing
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_normwise_close(compiled(prompt).logits, model(prompt).logits, _cpu_logits_tolerance(LAYERS), "logits")
    copied = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert isinstance(copied.model.layers[0].mlp, hf.FlashDMoEBlock)


@pytest.mark.parametrize("family", ["mixtral", "minimax"])
def test_router_jitter_is_applied_in_training(seed, family):
    torch.manual_seed(seed)
    config = _config(family)
    config.router_jitter_noise = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    patched = copy.deepcopy(model)
    hf.patch_moe(patched)
    assert all(b.jitter_noise == 0.1 for b in patched.modules() if isinstance(b, hf.FlashDMoEBlock))
    tolerance = _cpu_logits_tolerance(LAYERS)

    def jittered(run, prompt):
        torch.manual_seed(seed + 1)  # the same noise draws for both models
        with torch.no_grad():
            return run(prompt).logits

    generator = torch.Generator().manual_seed(seed)
    for _ in range(ATTEMPTS):
        prompt = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=generator)
        clear, want = _routing_clear(model, lambda: jittered(model, prompt), _cpu_router_margin)
        if clear:
            break
    else:
        pytest.fail(f"no prompt among {ATTEMPTS} drawn from seed {seed} routes without a near-tie")
    assert_normwise_close(jittered(patched, prompt), want, tolerance, "logits with router jitter")
    with torch.no_grad():
        unjittered = patched.eval()(prompt).logits
    assert numerics.normwise_error(unjittered, want) > tolerance  # the jitter did change the result


def test_relayout_for_the_kernel_keeps_values_shapes_and_identity(seed, tmp_path):
    model = _model("qwen3_moe", seed)
    experts = model.model.layers[0].mlp.experts
    before = {name: (p, p.detach().clone()) for name, p in experts.named_parameters()}
    assert hf._relayout_for_kernel(experts) == ["gate_up_proj", "down_proj"]
    for name, (parameter, values) in before.items():
        now = getattr(experts, name)
        assert now is parameter and torch.equal(now, values) and now.shape == values.shape
        assert now.transpose(1, 2).is_contiguous()  # [E, H, 2I] and [E, I, H] row-major for the kernel
    assert hf._relayout_for_kernel(experts) == []
    model.save_pretrained(tmp_path)  # a re-laid model still saves as a standard checkpoint
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.layers[0].mlp.experts.gate_up_proj, before["gate_up_proj"][1])


# ----------------------------------------------------------------------------------------------------------
# The text MoE blocks of multimodal models, one block at a time
# ----------------------------------------------------------------------------------------------------------
#
# Qwen3-VL-MoE's and Qwen3-Omni-MoE's models need their vision and audio towers to run; their text blocks
# are what patch_moe replaces, so each is checked on its own: output and gradients (of the input and of
# every parameter) against the unmodified block, in float32 on CPU. One block: GEMM1 over H, GEMM2 over
# I and the combine over k in other orders (depth 3); its backward adds three more (depth 6, over
# max(H, 2I, E, T) terms).


def _multimodal_block(kind: str) -> nn.Module:
    omni_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")
    omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
    vl_config = pytest.importorskip("transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe")
    vl = pytest.importorskip("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")

    sizes = dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS, num_experts_per_tok=4,
                 hidden_act="silu")
    if kind == "qwen3_vl_moe":  # always renormalised
        config, block = vl_config.Qwen3VLMoeTextConfig(**sizes), vl.Qwen3VLMoeTextSparseMoeBlock
    elif kind == "qwen3_omni_thinker":
        config, block = omni_config.Qwen3OmniMoeTextConfig(**sizes, norm_topk_prob=False), \
            omni.Qwen3OmniMoeThinkerTextSparseMoeBlock
    elif kind == "qwen3_omni_talker":  # shared expert with its sigmoid gate
        config = omni_config.Qwen3OmniMoeTalkerTextConfig(**sizes, norm_topk_prob=True,
                                                          shared_expert_intermediate_size=INTERMEDIATE)
        block = omni.Qwen3OmniMoeTalkerTextSparseMoeBlock
    else:
        raise AssertionError(kind)
    config._experts_implementation = "eager"  # what a loaded model dispatches to by default
    return block(config)


class _Layer(nn.Module):
    """A decoder layer's place for the block: patch_moe replaces ``mlp``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.mlp = block

    def forward(self, x):
        return self.mlp(x)


MULTIMODAL_KINDS = ["qwen3_vl_moe", "qwen3_omni_thinker", "qwen3_omni_talker"]


def _compare_multimodal_block(kind, seed, *, device, backend, output_tolerance, grad_tolerance, router_margin):
    """The block of ``kind`` (weights drawn from ``seed``) on ``device``, patched with ``backend``, against
    itself unpatched: output and the gradients of the input and of every parameter, on an input drawn
    from ``seed`` whose routing clears ``router_margin``."""
    layer = _Layer(_multimodal_block(kind))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # built outside a model, the block has no initialised weights: draw them
        for name, parameter in layer.named_parameters():
            fan_in = parameter.shape[-1]
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in ** 0.5)
    layer = layer.to(device)
    patched = copy.deepcopy(layer)
    assert hf.patch_moe(patched, backend=backend) == ["mlp"]
    assert isinstance(patched.mlp, hf.FlashDMoEBlock) and patched.mlp.replaced == type(layer.mlp).__name__
    assert list(patched.state_dict()) == list(layer.state_dict())
    for _ in range(ATTEMPTS):
        x = torch.randn(BATCH, PROMPT, HIDDEN, generator=generator).to(device)
        with torch.no_grad():
            clear, _ = _routing_clear(layer, lambda: layer(x), router_margin)
        if clear:
            break
    else:
        pytest.fail(f"no input among {ATTEMPTS} drawn from seed {seed} routes without a near-tie")
    dy = torch.randn(BATCH, PROMPT, HIDDEN, generator=generator).to(device)
    results = []
    for run in (layer, patched):
        xs = x.clone().requires_grad_(True)
        y = run(xs)
        (y * dy).sum().backward()
        results.append((y.detach(), xs.grad, {name: p.grad for name, p in run.named_parameters()}))
    (want_y, want_dx, want_grads), (got_y, got_dx, got_grads) = results
    assert_normwise_close(got_y, want_y, output_tolerance, "output")
    assert_normwise_close(got_dx, want_dx, grad_tolerance, "grad of the input")
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        assert grad is not None and got_grads[name] is not None, name
        assert_normwise_close(got_grads[name], grad, grad_tolerance, f"grad of {name}")


@pytest.mark.parametrize("kind", MULTIMODAL_KINDS)
def test_multimodal_text_block_matches(seed, kind):
    _compare_multimodal_block(
        kind, seed, device="cpu", backend="auto",
        output_tolerance=numerics.reorder_tolerance(torch.float32, max(HIDDEN, INTERMEDIATE), depth=3),
        grad_tolerance=numerics.reorder_tolerance(torch.float32, max(HIDDEN, 2 * INTERMEDIATE, EXPERTS, BATCH * PROMPT),
                                                  depth=6),
        router_margin=_cpu_router_margin)


# ----------------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------------


def test_deepseek_v3_is_refused_naming_what_differs(seed):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as error:
        hf.patch_moe(model)
    message = str(error.value)
    assert "model.layers.1.mlp (DeepseekV3MoE)" in message and "model.layers.0" not in message
    for difference in ("sigmoid scores", "e_score_correction_bias", "group-limited top-k (n_group=2, topk_group=1)",
                       "routed_scaling_factor=2.5", "softmax"):
        assert difference in message
    assert not any(isinstance(m, hf.FlashDMoEBlock) for m in model.modules())


@pytest.mark.parametrize("family, block, expected", [
    ("Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock", "a score-correction bias added before the top-k (moe_statics)"),
    ("PhimoeConfig", "PhimoeSparseMoeBlock", "sparsemixer routing"),
    ("HunYuanMoEV1Config", "HunYuanMoEV1Moe", "a shared expert added without a sigmoid gate (shared_mlp)"),
])
def test_other_families_are_refused_naming_what_differs(seed, family, block, expected):
    config = _transformers_class(family)()
    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                 moe_intermediate_size=INTERMEDIATE, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=EXPERTS, num_local_experts=EXPERTS)
    for name, value in sizes.items():
        if hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as error:
        hf.patch_moe(model)
    assert f"({block}): " in str(error.value) and expected in str(error.value)
    assert not any(isinstance(m, hf.FlashDMoEBlock) for m in model.modules())


class _OtherMoE(nn.Module):
    """An MoE block of a family patch_moe does not know."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=True)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))


def test_unknown_block_is_refused_and_nothing_is_patched(seed):
    model = _model("mixtral", seed)
    model.model.layers[1].mlp = _OtherMoE()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp \(_OtherMoE\): a router bias"):
        hf.patch_moe(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_model_without_moe_is_refused(seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="no sparse MoE block found"):
        hf.patch_moe(transformers.AutoModelForCausalLM.from_config(config))


def test_backend_argument(seed):
    model = _model("olmoe", seed)
    with pytest.raises(ValueError, match="backend='fast'"):
        hf.patch_moe(model, backend="fast")
    with pytest.raises(BackendUnavailable, match="CUDA"):
        hf.patch_moe(model, backend="cuda")  # CPU parameters: the kernel cannot run them
    assert hf.patch_moe(model, backend="reference") == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_cohere2_sigmoid_selection_is_refused(seed):
    config = _config("cohere2_moe")
    config.expert_selection_fn = "sigmoid"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"gate\.expert_selection_fn='sigmoid'; flashdmoe's routing is the "
                                         r"expert_selection_fn='softmax' one"):
        hf.patch_moe(model)
    assert not any(isinstance(m, hf.FlashDMoEBlock) for m in model.modules())


def test_activation_other_than_silu_is_refused(seed):
    config = _config("qwen3_moe")
    config.hidden_act = "gelu"
    torch.manual_seed(seed)
    with pytest.raises(ValueError, match="activation .* is not silu"):
        hf.patch_moe(transformers.AutoModelForCausalLM.from_config(config))


# ----------------------------------------------------------------------------------------------------------
# GPU: the fused kernel (one MoE layer, sizes the kernel takes: H % 64 == I % 64 == 0)
# ----------------------------------------------------------------------------------------------------------
#
# float32: transformers computes in float32, the kernel's expert GEMMs in TF32 and its router GEMM in
# 3xTF32 (float32-accurate). One block differs by at most numerics.kernel_tolerance(float32) relative to
# its output, which the layers after it carry to the logits; the router logits of the single block see
# identical inputs and differ by a float32 reduction over H. bfloat16: transformers rounds the router
# logits, the intermediate, each expert's output, the combine weights and each of the k partial sums to
# bfloat16 (4 + k roundings of u/2 each, at most rounding_tolerance(bfloat16, 4 + k) together) where the
# kernel keeps them in float32; the two differ by at most that plus the kernel's own bound.


def _gpu_patched_pair(family, seed, dtype):
    from flashdmoe.kernel import extension

    extension.load()  # a build failure on the GPU machine is a failure, not a skip
    model = _model(family, seed, layers=1).to(device="cuda", dtype=dtype)
    patched = copy.deepcopy(model)
    assert hf.patch_moe(patched, backend="cuda") == [f"model.layers.0.{_block_attr(family)}"]
    block = getattr(patched.model.layers[0], _block_attr(family))
    assert block.kernel and block.experts.gate_up_proj.transpose(1, 2).is_contiguous()
    return model, patched


def _gpu_router_margin(index, x, weight):
    return 2 * numerics.reorder_tolerance(torch.float32, HIDDEN) * x.norm(dim=1) * weight.norm(dim=1).max()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_float32_logits_generation_and_gradients(seed, family):
    model, patched = _gpu_patched_pair(family, seed, torch.float32)
    tolerance = numerics.kernel_tolerance(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(ATTEMPTS):
        prompt = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=generator).cuda()
        want = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            clear, want_logits = _routing_clear(model, lambda: model(want).logits, _gpu_router_margin)
        if clear:
            break
    else:
        pytest.fail(f"no sequence among {ATTEMPTS} drawn from seed {seed} routes without a near-tie")
    with torch.no_grad():
        got_logits = patched(want).logits
    assert_normwise_close(got_logits, want_logits, tolerance, "logits")
    # Greedy decoding, teacher-forced on the unmodified model's sequence: wherever its top-1 logit leads
    # the runner-up by more than the most two models agreeing to `tolerance` can disagree on
    # (2 * tolerance * ||logits||), the patched model picks the same token. TF32 rounding leaves too
    # little margin to demand it at every step of a random tiny model.
    top = want_logits.double().topk(2, dim=-1)
    decided = top.values[..., 0] - top.values[..., 1] > 2 * tolerance * want_logits.double().norm(dim=-1)
    assert decided.any(), "no position with a clear greedy choice: the check would be vacuous"
    assert torch.equal(got_logits.argmax(dim=-1)[decided], top.indices[..., 0][decided])
    prompt = want
    grads = []
    for run in (model, patched):
        run.train()
        run(prompt, labels=prompt, output_router_logits=True).loss.backward()
        grads.append({name: p.grad for name, p in run.named_parameters()})
    # forward and backward each within the kernel bound (TF32 GEMMs), plus the float32 reorderings
    grad_tolerance = 2 * tolerance + numerics.reorder_tolerance(
        torch.float32, max(HIDDEN, 2 * INTERMEDIATE, EXPERTS, BATCH * PROMPT), depth=6)
    for name, grad in grads[0].items():
        if grad is not None:
            assert_normwise_close(grads[1][name], grad, grad_tolerance, f"grad of {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bfloat16_logits(seed, family):
    model, patched = _gpu_patched_pair(family, seed, torch.bfloat16)
    top_k = getattr(patched.model.layers[0], _block_attr(family)).top_k
    tolerance = numerics.kernel_tolerance(torch.bfloat16) + numerics.rounding_tolerance(torch.bfloat16, 4 + top_k)
    unit = numerics.precision(torch.bfloat16).unit_roundoff

    def router_margin(index, x, weight):  # transformers rounds each bfloat16 logit: |dl| <= u * |l|
        return 2 * (unit * (x @ weight.T).abs().max(dim=1).values + _gpu_router_margin(index, x, weight) / 2)

    generator = torch.Generator().manual_seed(seed)
    for _ in range(ATTEMPTS):
        prompt = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=generator).cuda()
        with torch.no_grad():
            clear, want = _routing_clear(model, lambda: model(prompt).logits, router_margin)
        if clear:
            break
    else:
        pytest.fail(f"no prompt among {ATTEMPTS} drawn from seed {seed} routes without a near-tie")
    with torch.no_grad():
        assert_normwise_close(patched(prompt).logits, want, tolerance, "logits")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MULTIMODAL_KINDS)
def test_gpu_multimodal_text_block_float32(seed, kind):
    """The fused kernel on one multimodal text block, float32 (TF32 expert GEMMs): the tolerances of
    test_gpu_float32_logits_generation_and_gradients for one block."""
    from flashdmoe.kernel import extension

    extension.load()  # a build failure on the GPU machine is a failure, not a skip
    tolerance = numerics.kernel_tolerance(torch.float32)
    _compare_multimodal_block(
        kind, seed, device="cuda", backend="cuda", output_tolerance=tolerance,
        grad_tolerance=2 * tolerance + numerics.reorder_tolerance(
            torch.float32, max(HIDDEN, 2 * INTERMEDIATE, EXPERTS, BATCH * PROMPT), depth=6),
        router_margin=_gpu_router_margin)
