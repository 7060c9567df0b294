"""NaN / Inf in the weights (``router_weight``, ``w1``, ``w2``) raise ``ValueError`` naming the weight.

The router logits are checked by the kernel (a status flag) and ``x`` by :mod:`flashdmoe.validation`, but
a non-finite expert weight would only show up as a non-finite output. So the forward entry points
(:func:`flashdmoe.moe`, :func:`flashdmoe.moe_expert_parallel` and the ``torch.ops.flashdmoe.moe_forward``
op) scan each weight the first time they see it, and remember that it was finite under the key
``(data_ptr, version counter, shape, strides, dtype, device)`` plus a weak reference to its storage. A
forward with weights already seen reads a few attributes and makes no device work and no host
synchronisation; a forward with new weights (a new tensor, or one changed in place) makes one fused
reduction per weight and one host synchronisation for all of them.

What counts as a change:

* any in-place write through the tensor or a view of it (``copy_``, ``load_state_dict``, ``nn.init``,
  optimizers with ``foreach``) bumps the version counter;
* every ``torch.optim`` step forgets everything seen (a global optimizer step hook), because fused
  optimizers (``fused=True``) update parameters without bumping their version counters;
* a storage that was freed is forgotten, so a new tensor at a recycled address is scanned again.

Not seen: writes through ``tensor.data`` (a separate version counter), through DLPack / NumPy aliases or
by other processes; inference tensors changed in place inside ``torch.inference_mode`` (they have no
version counter). Call :func:`forget` after such a write to have the weights scanned again.

Skipped: inside a CUDA-graph capture (a capture cannot read device values; the eager warm-up forward that
a capture needs anyway scans the weights, and replays are not re-checked), while ``torch.compile``
traces (the registered op checks when it runs), and tensors without readable storage (``torch.func``
transforms, fake tensors).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["check_finite_weights", "forget"]

#: Weights remembered at most; past this, freed ones are dropped, then all.
LIMIT = 4096

_Key = tuple
_seen: dict[_Key, StorageWeakRef] = {}


def forget() -> None:
    """Scan every weight again at its next forward (after a write the version counter does not see)."""
    _seen.clear()


_optimizer_hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: forget())


def _key(tensor: torch.Tensor) -> _Key | None:
    """The cache key of ``tensor``, or ``None`` when it has no storage to read (nothing to check)."""
    if tensor.device.type == "meta":
        return None
    try:
        pointer = tensor.data_ptr()
    except RuntimeError:  # a torch.func wrapper or another tensor without storage
        return None
    if pointer == 0 and tensor.numel() > 0:  # a fake tensor
        return None
    # Inference tensors have no version counter; they cannot be written outside inference mode.
    version = -1 if tensor.is_inference() else tensor._version
    return pointer, version, tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def _remember(key: _Key, tensor: torch.Tensor) -> None:
    if len(_seen) >= LIMIT:
        for stale in [key for key, storage in _seen.items() if storage.expired()]:
            del _seen[stale]
        if len(_seen) >= LIMIT:
            _seen.clear()
    _seen[key] = StorageWeakRef(tensor.untyped_storage())


def check_finite_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise ``ValueError`` naming the first of ``weights`` (``(name, tensor)`` pairs, one device) that
    holds NaN or Inf, scanning only those not seen before (see the module docstring)."""
    if torch.compiler.is_compiling():
        return
    new = []
    for name, tensor in weights:
        key = _key(tensor)
        if key is None:
            continue
        storage = _seen.get(key)
        if storage is None or storage.expired():
            new.append((name, tensor, key))
    if not new:
        return
    if new[0][1].is_cuda and torch.cuda.is_current_stream_capturing():
        return
    for (name, tensor, key), ok in zip(new, _sums_finite([tensor for _, tensor, _ in new])):
        if not ok:
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(f"{name}: contains {bad} non-finite value(s) (NaN or Inf); expected finite "
                                 "weights")
        _remember(key, tensor)


@torch.no_grad()
def _sums_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor's sum is finite: one reduction per tensor, one host synchronisation in all.

    A float32 (float64) sum is non-finite iff an element is, barring the overflow of a huge finite sum
    (which the caller's exact count rules out); unlike ``isfinite(w).all()`` it needs no weight-sized
    temporary."""
    sums = [tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32) for tensor in tensors]
    return torch.isfinite(torch.stack(sums)).tolist()
