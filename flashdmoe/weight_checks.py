"""NaN / Inf in the weights (``router_weight``, ``w1``, ``w2``) raise ``ValueError`` naming the weight.

The router logits are checked by the kernel (a status flag) and ``x`` by :mod:`flashdmoe.validation`, but
a non-finite expert weight would only show up as a non-finite output. So the forward entry points
(:func:`flashdmoe.moe`, :func:`flashdmoe.moe_expert_parallel` and the ``torch.ops.flashdmoe.moe_forward``
op) scan each weight the first time they see it, and remember it under the key
``(data_ptr, version counter, shape, strides, dtype, device)`` plus a weak reference to its storage. A
forward with weights already seen reads a few attributes and makes no device work.

How a scan runs depends on where the forward runs:

* **Fused CUDA forwards** (``backend="cuda"``, or ``"auto"`` on a GPU) scan asynchronously: one min/max
  reduction per new weight, queued on the current stream ahead of the launch, an asynchronous copy of the
  results into pinned memory and an event behind it; nothing waits. The result is checked, and its
  ``ValueError`` raised once, where the kernel's own errors are (:mod:`flashdmoe.kernel.status_checks`): at the
  next fused forward if the scan has finished by then, before a team's next use, at
  :func:`flashdmoe.check_errors` (finished scans) and :func:`flashdmoe.synchronize` (waits), and at the
  call itself in debug mode (``FLASHDMOE_SYNC_CHECKS=1`` / :func:`flashdmoe.set_sync_checks`). The forward
  that used the weight runs on it (its output holds NaN / Inf); after the error the weight is forgotten, so
  the next forward with it is scanned, and fails, again.
* **The reference backend and CPU tensors** scan synchronously and raise at the call (the reference
  waits for the device anyway).

What counts as a change:

* any in-place write through the tensor or a view of it (``copy_``, ``load_state_dict``, ``nn.init``,
  optimizers with ``foreach``) bumps the version counter;
* every ``torch.optim`` step forgets everything seen (a global optimizer step hook), because fused
  optimizers (``fused=True``) update parameters without bumping their version counters;
* a storage that was freed is forgotten, so a new tensor at a recycled address is scanned again.

Not seen: writes through ``tensor.data`` (a separate version counter), through DLPack / NumPy aliases or
by other processes; inference tensors changed in place inside ``torch.inference_mode`` (they have no
version counter). Call :func:`forget` after such a write to have the weights scanned again.

Skipped: inside a CUDA-graph capture (a capture cannot queue a check that is read later; the eager warm-up
forward that a capture needs anyway scans the weights, and replays are not re-checked), while
``torch.compile`` traces (the registered op checks when it runs), and tensors without readable storage
(``torch.func`` transforms, fake tensors).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["WeightScan", "check_finite_weights", "epoch", "forget"]

#: Weights remembered at most; past this, freed ones are dropped, then all.
LIMIT = 4096

_Key = tuple
_seen: dict[_Key, StorageWeakRef] = {}


class _Epoch:
    """Bumped whenever something seen is forgotten, so that callers caching "these weights were checked"
    (:mod:`flashdmoe.api`'s call cache) know to ask again."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


_epoch = _Epoch()


def epoch() -> int:
    """The current epoch: a cached "checked" from an earlier epoch no longer holds."""
    return _epoch.value


def forget() -> None:
    """Scan every weight again at its next forward (after a write the version counter does not see)."""
    _seen.clear()
    _epoch.value += 1


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


def _drop(key: _Key) -> None:
    """Forget one weight (its scan failed), and invalidate every cached "checked"."""
    _seen.pop(key, None)
    _epoch.value += 1


def check_finite_weights(weights: Iterable[tuple[str, torch.Tensor]], *, asynchronous: bool = False) -> bool:
    """Check ``weights`` (``(name, tensor)`` pairs, one device) for NaN / Inf, scanning only those not seen
    before (see the module docstring).

    ``asynchronous`` (CUDA tensors only; the fused backend's forwards): queue the scan and return; its
    error surfaces later (:class:`WeightScan`). Otherwise raise ``ValueError`` naming the first non-finite
    weight now.

    Returns whether every weight is now remembered (checked, or its check queued); ``False`` when a scan
    was skipped (inside a capture, under ``torch.compile``).
    """
    if torch.compiler.is_compiling():
        return False
    new = []
    for name, tensor in weights:
        key = _key(tensor)
        if key is None:
            continue
        storage = _seen.get(key)
        if storage is None or storage.expired():
            new.append((name, tensor, key))
    if not new:
        return True
    first = new[0][1]
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    if asynchronous and _scans_asynchronously(first):
        _queue_scan(new)
        return True
    for (name, tensor, key), (low, high) in zip(new, _extremes([tensor for _, tensor, _ in new]).tolist()):
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(_message(name, tensor))
        _remember(key, tensor)
    return True


def _message(name: str, tensor: torch.Tensor | None) -> str:
    """The error for a weight whose scan found NaN / Inf (counted now: an error path may synchronise)."""
    bad = 0 if tensor is None else int((~torch.isfinite(tensor)).sum())
    if bad:
        return f"{name}: contains {bad} non-finite value(s) (NaN or Inf); expected finite weights"
    gone = "been freed" if tensor is None else "been overwritten with finite values"
    return (f"{name}: contained non-finite values (NaN or Inf) when a forward used it (it has {gone} since); "
            "expected finite weights")


@torch.no_grad()
def _extremes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[n, 2]`` (min, max) of each tensor, on their device, without waiting for it.

    ``aminmax`` propagates NaN and keeps +-Inf, so a tensor holds NaN / Inf exactly when its min or max is
    not finite: one reduction per tensor, no weight-sized temporary and no false alarm (a float32 sum could
    overflow on huge finite weights). Empty tensors count as (0, 0)."""
    parts: list[torch.Tensor] = []
    for tensor in tensors:
        parts.extend((tensor.new_zeros(()),) * 2 if tensor.numel() == 0 else torch.aminmax(tensor))
    if any(part.dtype != parts[0].dtype for part in parts):
        parts = [part.to(torch.float64) for part in parts]  # exact for every floating dtype's extremes
    return torch.stack(parts).view(-1, 2)


class WeightScan:
    """A queued scan of new weights: an entry of :mod:`flashdmoe.kernel.status_checks`'s queue, checked at the
    same points as a launch's status (its ``ready`` / ``keep_status`` / ``exception`` interface).

    Holds weak references to the weights (a scan never keeps a weight alive) and their cache keys, so a
    failed weight is forgotten again when its error is raised."""

    __slots__ = ("device", "checked", "captured", "team", "queued_after", "_names", "_tensors", "_keys", "_buffer",
                 "_host", "_event", "_values")

    def __init__(self, device: int, names: list[str], tensors: list[torch.Tensor], keys: list[_Key],
                 buffer: torch.Tensor, host: torch.Tensor, event: Any) -> None:
        self.device = device
        self.checked = False
        self.captured = False
        self.team = None
        self._names = names
        self._tensors = [weakref.ref(tensor) for tensor in tensors]
        self._keys = keys
        self._buffer = buffer  # pinned, from the pool; host: its view holding the (min, max) pairs
        self._host = host
        self._event = event
        self._values: list | None = None

    def __repr__(self) -> str:
        return f"WeightScan({', '.join(self._names)} on cuda:{self.device}, {'checked' if self.checked else 'pending'})"

    def ready(self) -> bool:
        """Whether the scan's results are on the host (never blocks)."""
        return self._values is not None or bool(self._event.query())

    def wait(self) -> None:
        if self._values is None:
            self._event.synchronize()

    def keep_status(self) -> None:
        """Wait for the results and read them (the pinned buffer then goes back to the pool)."""
        if self._values is None:
            self.wait()
            self._values = self._host.tolist()
            _give_back_pinned(self._buffer)
            self._buffer = self._host = self._event = None

    def exception(self) -> ValueError | None:
        """``ValueError`` naming the first weight that held NaN / Inf (which is then forgotten, so the next
        forward with it is scanned again), or ``None``."""
        self.keep_status()
        for name, ref, key, (low, high) in zip(self._names, self._tensors, self._keys, self._values):
            if not (math.isfinite(low) and math.isfinite(high)):
                _drop(key)
                return ValueError(_message(name, ref()) + f" [scanned ahead of a fused forward on cuda:{self.device}]")
        return None


def _scans_asynchronously(tensor: torch.Tensor) -> bool:
    """Whether a scan of ``tensor`` can be queued and read later (CUDA; tests/fake_cuda.py says CPU too)."""
    return tensor.is_cuda


#: Pinned buffers for scan results, reused: a page-locked allocation may serialise the device's streams,
#: so after the first scans none is made per scan.
_pinned: list[torch.Tensor] = []
_PINNED_BYTES = 1024  # 64 weights' (min, max) in float64


def _allocate_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pinned_like(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, host)``: a pinned buffer from the pool and its view of ``values``' shape and dtype."""
    nbytes = values.numel() * values.element_size()
    try:
        buffer = _pinned.pop()  # atomic under the GIL
    except IndexError:
        buffer = _allocate_pinned(max(nbytes, _PINNED_BYTES))
    if buffer.numel() < nbytes:
        _pinned.append(buffer)
        buffer = _allocate_pinned(nbytes)
    return buffer, buffer[:nbytes].view(values.dtype).view(values.shape)


def _give_back_pinned(buffer: torch.Tensor) -> None:
    if len(_pinned) < 64:
        _pinned.append(buffer)


def _record_event(device: torch.device) -> Any:
    """A CUDA event recorded on ``device``'s current stream (where the scan and its copy were queued,
    whichever device is current)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _queue_scan(new: list[tuple[str, torch.Tensor, _Key]]) -> None:
    """Queue the scan of ``new`` on the current stream and remember the weights (as checked: a failure
    forgets them when it is raised)."""
    from flashdmoe.kernel import status_checks

    tensors = [tensor for _, tensor, _ in new]
    values = _extremes(tensors)
    buffer, host = _pinned_like(values)
    host.copy_(values, non_blocking=True)
    device = tensors[0].device
    event = _record_event(device)
    scan = WeightScan(device.index, [name for name, _, _ in new], tensors, [key for _, _, key in new], buffer, host,
                      event)
    for _, tensor, key in new:
        _remember(key, tensor)
    status_checks.queued(scan)
