"""Hugging Face transformers: run the sparse MoE blocks of a loaded model on flashdmoe, in one call.

::

    from flashdmoe.integrations.transformers import patch_moe
    replaced = patch_moe(model)          # ['model.layers.0.mlp', 'model.layers.1.mlp', ...]

transformers :data:`SUPPORTED_TRANSFORMERS` (the ``flashdmoe[hf]`` extra): from 5.0 on, the MoE blocks
hold their experts as two fused 3-D parameters and route in a ``TopKRouter`` submodule; the 4.x blocks
(one ``nn.Linear`` per expert projection, routing inline) are not handled.

Replaced: the blocks whose routing is flashdmoe's (softmax top-k, renormalised or not) into SwiGLU experts
-- Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, the text blocks of Qwen3-VL-MoE and Qwen3-Omni-MoE
(thinker and talker), OLMoE, FlexOlmo, MiniMax, Granite-MoE (plain, shared, hybrid), Cohere2-MoE (its
softmax selection); a shared expert (the Qwen families' sigmoid-gated one, Cohere2-MoE's summed or averaged
one) is kept. Any other block holding ``experts``
(DeepSeek-V3's sigmoid scores with a correction bias and group-limited top-k, GPT-OSS, ...) is refused
with what differs named, and nothing is patched. The replacement holds the original submodules, so
parameter names, ``state_dict`` keys and the parameter objects are unchanged; the experts are read as
transposed views (re-laid in place once for the fused kernel). docs/integrations.md has the details.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashdmoe import ops, reference
from flashdmoe.api import BACKENDS, resolve_backend

__all__ = ["SUPPORTED_TRANSFORMERS", "FlashDMoEBlock", "check_transformers_version", "patch_moe"]

#: The transformers releases this module is written and tested for (also the ``flashdmoe[hf]`` pin).
SUPPORTED_TRANSFORMERS = ">=5.0,<6"


@dataclass(frozen=True)
class _Family:
    name: str
    module: str  # where transformers defines the block, router and experts classes
    router: str
    experts: str
    renormalise: str | None  # the router attribute that says whether the top-k are renormalised; None: always
    # A shared expert beside the routed ones: "gated" (shared_expert, scaled by sigmoid(shared_expert_gate(x))
    # and added), "combined" (shared_experts where the block's num_shared_experts > 0, summed with or averaged
    # into the routed output as its shared_expert_combination_strategy says), or None.
    shared: str | None
    router_attr: str = "gate"  # the block's name for its router submodule
    router_requires: tuple[tuple[str, str], ...] = ()  # (router attribute, the value flashdmoe's routing needs)


_FAMILIES = {
    "MixtralSparseMoeBlock": _Family("Mixtral", "transformers.models.mixtral.modeling_mixtral",
                                     "MixtralTopKRouter", "MixtralExperts", None, None),
    "Qwen2MoeSparseMoeBlock": _Family("Qwen2-MoE", "transformers.models.qwen2_moe.modeling_qwen2_moe",
                                      "Qwen2MoeTopKRouter", "Qwen2MoeExperts", "norm_topk_prob", "gated"),
    "Qwen3MoeSparseMoeBlock": _Family("Qwen3-MoE", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                                      "Qwen3MoeTopKRouter", "Qwen3MoeExperts", "norm_topk_prob", None),
    "Qwen3NextSparseMoeBlock": _Family("Qwen3-Next", "transformers.models.qwen3_next.modeling_qwen3_next",
                                       "Qwen3NextTopKRouter", "Qwen3NextExperts", "norm_topk_prob", "gated"),
    "Qwen3_5MoeSparseMoeBlock": _Family("Qwen3.5-MoE", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                                        "Qwen3_5MoeTopKRouter", "Qwen3_5MoeExperts", None, "gated"),
    "Qwen3VLMoeTextSparseMoeBlock": _Family("Qwen3-VL-MoE", "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
                                            "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextExperts", None, None),
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": _Family(
        "Qwen3-Omni-MoE thinker", "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
        "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeThinkerTextExperts", "norm_topk_prob", None),
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": _Family(
        "Qwen3-Omni-MoE talker", "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
        "Qwen3OmniMoeTalkerTextTopKRouter", "Qwen3OmniMoeTalkerTextExperts", "norm_topk_prob", "gated"),
    "OlmoeSparseMoeBlock": _Family("OLMoE", "transformers.models.olmoe.modeling_olmoe",
                                   "OlmoeTopKRouter", "OlmoeExperts", "norm_topk_prob", None),
    "FlexOlmoSparseMoeBlock": _Family("FlexOlmo", "transformers.models.flex_olmo.modeling_flex_olmo",
                                      "FlexOlmoTopKRouter", "FlexOlmoExperts", "norm_topk_prob", None),
    "MiniMaxSparseMoeBlock": _Family("MiniMax", "transformers.models.minimax.modeling_minimax",
                                     "MiniMaxTopKRouter", "MiniMaxExperts", None, None),
    # Cohere2-MoE: a top-k of the logits, then the softmax of those k (the same weights as the softmax's top-k
    # renormalised); its sigmoid selection is another routing.
    "Cohere2MoeSparseMoeBlock": _Family("Cohere2-MoE", "transformers.models.cohere2_moe.modeling_cohere2_moe",
                                        "Cohere2MoeTopKRouter", "Cohere2MoeExperts", None, "combined",
                                        router_requires=(("expert_selection_fn", "softmax"),)),
    # Granite: softmax over the top-k logits, which is the top-k of the softmax renormalised; the shared MLP
    # (GraniteMoeShared, GraniteMoeHybrid) sits in the decoder layer, outside the block.
    "GraniteMoeMoE": _Family("Granite-MoE", "transformers.models.granitemoe.modeling_granitemoe",
                             "GraniteMoeTopKRouter", "GraniteMoeExperts", None, None, "router"),
    "GraniteMoeSharedMoE": _Family(
        "Granite-MoE-Shared", "transformers.models.granitemoeshared.modeling_granitemoeshared",
        "GraniteMoeSharedTopKRouter", "GraniteMoeSharedExperts", None, None, "router"),
    "GraniteMoeHybridMoE": _Family(
        "Granite-MoE-Hybrid", "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
        "GraniteMoeHybridTopKRouter", "GraniteMoeHybridExperts", None, None, "router"),
}

_CONTRACT = ("flashdmoe routes with softmax(x @ router.T), a top-k and the k weights renormalised or not, "
             "into SwiGLU experts; patch_moe replaces " + ", ".join(_FAMILIES) + " only")


def check_transformers_version(version: str | None = None) -> str:
    """The installed transformers version (or ``version``) if it is in :data:`SUPPORTED_TRANSFORMERS`.

    Raises:
        ImportError: transformers is missing or outside the range; the message says what to install.
    """
    if version is None:
        try:
            import transformers
        except ImportError as error:
            raise ImportError(f"flashdmoe.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS}: "
                              "pip install 'flashdmoe[hf]'") from error
        version = transformers.__version__
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(version) not in SpecifierSet(SUPPORTED_TRANSFORMERS):
        raise ImportError(
            f"transformers {version} is installed; flashdmoe.integrations.transformers supports "
            f"transformers{SUPPORTED_TRANSFORMERS} (MoE blocks with fused 3-D expert parameters and a TopKRouter "
            "module; the 4.x blocks keep one nn.Linear per expert projection): pip install 'flashdmoe[hf]'")
    return version


_UNRESOLVED = object()
#: transformers' record of the outputs being captured (utils.output_capturing._active_collector), None
#: where a release records by wrapping module forwards instead and cannot be asked. Resolved when the
#: first block is made; a module global, not an attribute, so that patched models still copy and pickle.
_collector = _UNRESOLVED


def _resolve_output_collector() -> None:
    global _collector
    if _collector is _UNRESOLVED:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:
            _collector = None
        else:
            _collector = _active_collector


def _router_logits_recorded() -> bool:
    if _collector is None:
        return True  # cannot tell: run the router so that any recording sees it
    collected = _collector.get()
    return collected is not None and "router_logits" in collected


class FlashDMoEBlock(nn.Module):
    """A transformers sparse MoE block computed by flashdmoe (made by :func:`patch_moe`).

    Holds the original block's router (``gate``, or ``router`` for Granite) and ``experts``, and its
    shared expert where the family has one. ``forward(hidden_states [B, S, H]) -> [B, S, H]``: the routed
    experts through :func:`flashdmoe.ops.moe` (or :func:`flashdmoe.reference.moe` for ``backend="reference"``
    on CUDA), plus the shared expert as the original adds it: ``sigmoid(shared_expert_gate(x)) *
    shared_expert(x)`` (Qwen), or ``shared_experts(x)`` summed or averaged in (Cohere2-MoE).
    """

    def __init__(self, block: nn.Module, family: _Family, *, normalize_topk: bool, backend: str, kernel: bool):
        super().__init__()
        for name, child in block.named_children():  # in the original's order: state_dict keys stay the same
            self.add_module(name, child)
        # How the shared expert joins the routed output: "gated" (Qwen), "sum" or "average" (Cohere2-MoE with
        # shared experts, its strategy checked by patch_moe), or None
        self.shared = family.shared
        if family.shared == "combined":
            self.shared = block.shared_expert_combination_strategy if block.num_shared_experts > 0 else None
        self.family = family.name
        self.replaced = type(block).__name__
        self.router_attr = family.router_attr
        self.top_k = int(self.router.top_k)
        self.normalize_topk = normalize_topk
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.backend = backend
        self.kernel = kernel
        _resolve_output_collector()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            # In place, as the originals do: MiniMax's decoder layer keeps this very tensor as its residual,
            # so the jitter reaches the residual stream there too.
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, shape[-1])
        router = self.router
        if _router_logits_recorded():
            router(x)  # for transformers' hooks (router logits, load-balancing loss); its routing is unused
        # transformers computes chunk(x @ gate_up_proj[e].T, 2) = (gate, up): w1 [E, H, 2I], gate half first
        w1 = self.experts.gate_up_proj.transpose(1, 2)
        w2 = self.experts.down_proj.transpose(1, 2)
        options = dict(top_k=self.top_k, activation="swiglu", normalize_topk=self.normalize_topk)
        if x.is_cuda and not self.kernel:
            y = reference.moe(x, router.weight, w1, w2, **options)
        else:
            y = ops.moe(x, router.weight, w1, w2, **options)
        if self.shared == "gated":
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared == "sum":
            y = y + self.shared_experts(x)
        elif self.shared == "average":
            y = (y + self.shared_experts(x)) / 2
        return y.reshape(shape)

    @property
    def router(self) -> nn.Module:
        """The original block's router module (held under its original name)."""
        return self._modules[self.router_attr]

    def extra_repr(self) -> str:
        return (f"family={self.family}, replaced={self.replaced}, experts={self.router.weight.shape[0]}, "
                f"top_k={self.top_k}, normalize_topk={self.normalize_topk}, backend={self.backend}, "
                f"kernel={self.kernel}")


# ----------------------------------------------------------------------------------------------------------
# Which blocks, and why not
# ----------------------------------------------------------------------------------------------------------


def _family_of(module: nn.Module) -> _Family | None:
    cls = type(module)
    family = _FAMILIES.get(cls.__name__)
    return family if family is not None and cls.__module__ == family.module else None


def _source(function: Any) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _router_differences(block: nn.Module) -> list[str]:
    """What an unsupported MoE block's routing does that flashdmoe's does not (best effort, from the
    attributes and source of its router and of the block, where some releases route)."""
    router = block._modules.get("gate") or block._modules.get("router")
    if router is None:
        return ["no `gate` or `router` submodule to read the routing from"]

    def attribute(*names):
        for owner in (router, block):
            for name in names:
                value = getattr(owner, name, None)
                if value is not None:
                    return value
        return None

    found = []
    code = _source(type(router).forward) + "".join(
        _source(member) for name, member in vars(type(block)).items() if callable(member) and name != "__init__")
    if "sigmoid" in code and "softmax" not in code:
        found.append("sigmoid scores instead of a softmax")
    if isinstance(attribute("e_score_correction_bias"), torch.Tensor):
        found.append("a score-correction bias added before the top-k (e_score_correction_bias)")
    groups = attribute("n_group", "num_group")
    if isinstance(groups, int) and groups > 1:
        found.append(f"group-limited top-k (n_group={groups}, topk_group={attribute('topk_group')})")
    scale = attribute("routed_scaling_factor")
    if isinstance(scale, (int, float)) and scale != 1:
        found.append(f"combine weights scaled by routed_scaling_factor={scale}")
    if attribute("moe_statics") is not None:
        found.append("a score-correction bias added before the top-k (moe_statics)")
    if "sparsemixer" in code:
        found.append("sparsemixer routing (each choice from its own masked softmax, not a top-k of one softmax)")
    if "sigmoid" not in code and attribute("expert_selection_fn") == "sigmoid":
        found.append("sigmoid scores instead of a softmax (expert_selection_fn='sigmoid')")
    if isinstance(getattr(router, "bias", None), torch.Tensor):
        found.append("a router bias")
    router_weights = [p for p in router.parameters() if p.dim() == 2]
    expert_weights = [p for p in block.experts.parameters() if p.dim() == 3]
    if router_weights and expert_weights and router_weights[0].dtype != expert_weights[0].dtype:
        found.append(f"the router in {router_weights[0].dtype} and the experts in {expert_weights[0].dtype}")
    expert_biases = [name for name, _ in block.experts.named_parameters() if "bias" in name]
    if expert_biases:
        found.append(f"expert biases ({', '.join(expert_biases[:4])})")
    for name in ("shared_experts", "shared_mlp"):  # added without a gate: not a form this module reads
        if name in block._modules:
            found.append(f"a shared expert added without a sigmoid gate ({name})")
    return found


def _silu(function: nn.Module) -> bool:
    probe = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
    try:
        return bool(torch.allclose(function(probe), F.silu(probe), rtol=1e-12, atol=1e-12))
    except Exception:  # an activation that cannot take the probe is not silu either
        return False


def _check_supported(name: str, block: nn.Module, family: _Family) -> bool:
    """Structural checks of a block of a supported family; returns whether it renormalises its top-k.
    Raises ValueError naming the block and what differs from the layout this module reads."""
    where = f"{name} ({type(block).__name__})"
    router = family.router_attr
    gate, experts = block._modules.get(router), block._modules.get("experts")
    if type(gate).__name__ != family.router or type(experts).__name__ != family.experts:
        raise ValueError(f"{where}: expected {router} {family.router} and experts {family.experts}, found "
                         f"{type(gate).__name__} and {type(experts).__name__}")
    gate_params = {n for n, _ in gate.named_parameters(recurse=False)}
    expert_params = {n for n, _ in experts.named_parameters(recurse=False)}
    if gate_params != {"weight"} or expert_params != {"gate_up_proj", "down_proj"}:
        raise ValueError(f"{where}: expected {router} parameters {{'weight'}} and expert parameters "
                         f"{{'gate_up_proj', 'down_proj'}} (no biases), found {gate_params} and {expert_params}")
    router_weight, gate_up, down = gate.weight, experts.gate_up_proj, experts.down_proj
    if router_weight.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{where}: expected {router}.weight [E, H], experts.gate_up_proj [E, 2I, H] and "
                         f"experts.down_proj [E, H, I], found {list(router_weight.shape)}, {list(gate_up.shape)} "
                         f"and {list(down.shape)}")
    num_experts, hidden = router_weight.shape
    intermediate = down.shape[2]
    if tuple(gate_up.shape) != (num_experts, 2 * intermediate, hidden) or tuple(down.shape) != (
            num_experts, hidden, intermediate):
        raise ValueError(f"{where}: expected experts.gate_up_proj [E={num_experts}, 2I, H={hidden}] and "
                         f"experts.down_proj [E, H, I], found {list(gate_up.shape)} and {list(down.shape)}")
    tensors = {f"{router}.weight": router_weight, "experts.gate_up_proj": gate_up, "experts.down_proj": down}
    if len({(t.dtype, t.device) for t in tensors.values()}) != 1 or router_weight.is_meta:
        found = ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"{where}: flashdmoe needs the router and the experts in one dtype on one device, "
                         f"resident (not offloaded to the meta device); {found}")
    top_k = getattr(gate, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{where}: {router}.top_k={top_k!r}; expected an int in [1, {num_experts}]")
    if not _silu(experts.act_fn):
        raise ValueError(f"{where}: the experts' activation {type(experts.act_fn).__name__} is not silu; "
                         "flashdmoe's swiglu is silu(gate) * up")
    for attribute, needed in family.router_requires:
        value = getattr(gate, attribute, None)
        if value != needed:
            raise ValueError(f"{where}: {router}.{attribute}={value!r}; flashdmoe's routing is the "
                             f"{attribute}={needed!r} one")
    if family.shared == "gated" and not {"shared_expert", "shared_expert_gate"} <= set(block._modules):
        raise ValueError(f"{where}: expected the shared_expert and shared_expert_gate submodules of its family")
    if family.shared == "combined":
        shared = getattr(block, "num_shared_experts", None)
        strategy = getattr(block, "shared_expert_combination_strategy", None)
        if not isinstance(shared, int) or shared < 0 or (shared > 0 and "shared_experts" not in block._modules):
            raise ValueError(f"{where}: num_shared_experts={shared!r} with submodules {list(block._modules)}; "
                             "expected 0, or a count and a shared_experts submodule")
        if shared > 0 and strategy not in ("sum", "average"):
            raise ValueError(f"{where}: shared_expert_combination_strategy={strategy!r}; expected 'sum' or "
                             "'average'")
    if family.renormalise is None:
        return True
    value = getattr(gate, family.renormalise, None)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {router}.{family.renormalise}={value!r}; expected True or False")
    return value


def _relayout_for_kernel(experts: nn.Module) -> list[str]:
    """Give ``gate_up_proj`` and ``down_proj`` storage whose transposes (``[E, H, 2I]``, ``[E, I, H]``) are
    row-major, as the fused kernel reads them, without changing the parameters' values, shapes or
    identity. Returns the names of the parameters that were re-laid (already laid out: none)."""
    moved = []
    for name in ("gate_up_proj", "down_proj"):
        parameter = getattr(experts, name)
        if parameter.transpose(1, 2).is_contiguous():
            continue
        with torch.no_grad():
            parameter.data = parameter.transpose(1, 2).contiguous().transpose(1, 2)
        moved.append(name)
    return moved


def patch_moe(model: nn.Module, *, backend: str = "auto") -> list[str]:
    """Replace every sparse MoE block of ``model`` by a :class:`FlashDMoEBlock` on the same parameters.

    Args:
        model: a loaded transformers model (any head) of a supported family; patched in place.
        backend: ``"auto"``, ``"reference"`` or ``"cuda"`` (as :func:`flashdmoe.moe`), resolved once here
            from the parameters' device and dtype.

    Returns:
        The qualified names of the replaced modules, in model order (``[]`` when every MoE block is
        already a :class:`FlashDMoEBlock`).

    Raises:
        ImportError: transformers outside :data:`SUPPORTED_TRANSFORMERS`.
        ValueError: an MoE block this module cannot replace (nothing is patched then), no MoE block at
            all, or a bad ``backend``.
        flashdmoe.BackendUnavailable: ``backend="cuda"`` and the fused kernel cannot run these parameters.
    """
    check_transformers_version()
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    plan, refused, already = [], [], 0
    for name, module in model.named_modules():
        if isinstance(module, FlashDMoEBlock):
            already += 1
            continue
        family = _family_of(module)
        if family is not None and not name:
            raise ValueError(f"model: is itself a {type(module).__name__}; pass the model that contains it")
        if family is not None:
            plan.append((name, module, family, _check_supported(name, module, family)))
        elif "experts" in module._modules:
            differences = _router_differences(module)
            detail = "; ".join(differences) if differences else "not one of the families checked against flashdmoe"
            refused.append(f"{name} ({type(module).__name__}): {detail}")
    if refused:
        raise ValueError("patch_moe cannot replace these MoE blocks (nothing was patched):\n  "
                         + "\n  ".join(refused) + f"\n{_CONTRACT}")
    if not plan:
        if already:
            return []
        raise ValueError(f"model ({type(model).__name__}): no sparse MoE block found; {_CONTRACT}")
    replaced = []
    for name, block, family, normalize_topk in plan:
        kernel = resolve_backend(getattr(block, family.router_attr).weight, backend) == "cuda"
        if kernel:
            _relayout_for_kernel(block.experts)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FlashDMoEBlock(block, family, normalize_topk=normalize_topk, backend=backend,
                                              kernel=kernel))
        replaced.append(name)
    return replaced
