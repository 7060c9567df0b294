"""Layer/run configuration (:class:`MoEConfig`) and the seeded weights and tokens it describes.

A config file is a flat YAML mapping of :class:`MoEConfig`'s fields, e.g. ``configs/tiny.yaml``.
Weights and tokens are pure functions of ``(seed, what, index)``: any rank can build exactly its own
expert shard or its own batch without materialising the others, and every backend and every
rank sees the same numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from flashdmoe import numerics
from flashdmoe.validation import ACTIVATIONS, check_capacity, validate_capacity_factor

__all__ = ["CONFIG_DTYPES", "MAX_CONFIG_BYTES", "DuplicateKeyError", "MoEConfig", "derive_seed",
           "load_yaml_mapping_text", "make_tokens", "make_weights", "seeded_randn"]

#: Parameter/activation dtypes a config may ask for: the kernel's (float64 is for tests, not configs).
CONFIG_DTYPES: dict[str, torch.dtype] = {name: p.dtype for name, p in numerics.DTYPES.items() if p.kernel}

_MAX_SEED = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: Largest config file read: a flat mapping of a dozen fields is a few hundred bytes; this bound keeps a
#: path such as /dev/zero from being read until memory runs out.
MAX_CONFIG_BYTES = 1 << 20


def _read_config_text(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory; expected a YAML config file") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read: {error.strerror or error}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES:,} bytes; expected a small YAML config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}); "
                         "expected a UTF-8 YAML config file") from None


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names one key twice (YAML itself forbids it; PyYAML would keep the last)."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping instead of keeping the last."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges; explicit keys may override them
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = first_lines.get(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if first is not None:
                    raise DuplicateKeyError(f"duplicate key {key!r} on line {line} (first given on line {first})")
                first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml_mapping_text(text: str, source: str) -> Any:
    """Parse YAML ``text`` with ``yaml.safe_load``'s types, refusing duplicate keys; errors name ``source``.

    Raises:
        ValueError: the text does not parse or repeats a key in a mapping.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except DuplicateKeyError as error:
        raise ValueError(f"{source}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: not valid YAML: {error}") from None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer and the run that exercises it.

    Attributes:
        hidden: ``H``, model width (>= 1).
        ffn: ``I``, expert intermediate size (>= 1).
        experts: ``E``, global experts; must divide by ``world_size``.
        top_k: ``k``, experts per token, ``1 <= k <= E``.
        tokens_per_rank: ``T``, tokens each rank feeds per step (>= 0).
        activation: ``relu``, ``gelu``, ``silu`` or ``swiglu``.
        normalize_topk: renormalise the top-k probabilities to sum to 1.
        capacity_factor: ``None`` for dropless, else ``c > 0``: each (source rank, expert) pair
            keeps ``ceil(c * T * k / E)`` rows.
        dtype: ``float32``, ``bfloat16`` or ``float16`` for weights and tokens.
        world_size: ``P``, ranks of the expert-parallel team (>= 1).
        seed: seeds weights and tokens, ``0 <= seed < 2**63``.
        steps: forward + backward steps a run performs (>= 1).
        step_timeout_s: on Ray, the longest one call (a step) may take on any rank before the team counts
            as hung and is replaced (seconds, finite, > 0); ``None``: derived from the layer's size
            (``ray_actors.cluster.default_step_timeout_s``, 20 s for small layers).
        nodes: on Ray, how many nodes the ranks span (>= 1, dividing ``world_size``): each of ``nodes``
            distinct nodes runs ``world_size // nodes`` ranks (one per GPU), rank ``r`` on node
            ``r // ranks_per_node`` (node-major); 1 keeps every rank on one node. Ignored by runs whose
            ranks share one process (``--in-process``).
        exchange: how a GPU team's forward rows reach owners on other nodes (``Team.nvshmem``):
            ``direct`` (each kept choice's row put to its owner) or ``hierarchical`` (a token's row once to
            each other node its choices reach, stored into the owners there by the rank with the sender's
            index on that node; docs/design.md §8); ``hierarchical`` needs ``nodes >= 2``.
    """

    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens_per_rank: int
    activation: str = "gelu"
    normalize_topk: bool = True
    capacity_factor: float | None = None
    dtype: str = "float32"
    world_size: int = 1
    seed: int = 0
    steps: int = 1
    step_timeout_s: float | None = None
    nodes: int = 1
    exchange: str = "direct"

    def __post_init__(self) -> None:
        minimums = {"hidden": 1, "ffn": 1, "experts": 1, "top_k": 1, "tokens_per_rank": 0,
                    "world_size": 1, "seed": 0, "steps": 1, "nodes": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name}={value!r} ({type(value).__name__}): expected an integer >= {minimum}")
            if value < minimum:
                raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
            object.__setattr__(self, name, int(value))
        if self.seed > _MAX_SEED:
            raise ValueError(f"seed={self.seed!r}: expected an integer in [0, 2**63 - 1]")
        if self.experts % self.world_size != 0:
            raise ValueError(
                f"experts={self.experts!r}: expected a multiple of world_size={self.world_size} "
                "(each rank holds experts // world_size experts)"
            )
        if self.world_size % self.nodes != 0:
            raise ValueError(
                f"nodes={self.nodes!r}: expected a divisor of world_size={self.world_size} "
                "(every node runs world_size // nodes ranks)"
            )
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k!r}: expected 1 <= top_k <= experts={self.experts}")
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")
        if not isinstance(self.normalize_topk, bool):
            raise ValueError(f"normalize_topk={self.normalize_topk!r}: expected true or false")
        object.__setattr__(self, "capacity_factor", validate_capacity_factor(self.capacity_factor))
        check_capacity(self.capacity_factor, self.tokens_per_rank, self.top_k, self.experts)
        if not isinstance(self.dtype, str) or self.dtype not in CONFIG_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(CONFIG_DTYPES)}")
        if self.step_timeout_s is not None:
            object.__setattr__(self, "step_timeout_s", _positive_seconds("step_timeout_s", self.step_timeout_s))
        if self.exchange not in ("direct", "hierarchical"):
            raise ValueError(f"exchange={self.exchange!r}: expected direct or hierarchical")
        if self.exchange == "hierarchical" and self.nodes < 2:
            raise ValueError(f"exchange='hierarchical': expected nodes >= 2 (rows cross nodes), got nodes={self.nodes}")

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of the config's fields, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> MoEConfig:
        """Build a config from a mapping of field names to values.

        Raises:
            ValueError: ``values`` is not a mapping, has unknown keys (all named), lacks a
                required field, or holds an invalid value.
        """
        if not isinstance(values, Mapping):
            raise ValueError(
                f"{source}: expected a mapping of field names to values, got {type(values).__name__}"
            )
        known = cls.field_names()
        unknown = sorted(str(key) for key in values if key not in known)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(known)}"
            )
        required = [field.name for field in dataclasses.fields(cls)
                    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {', '.join(missing)}")
        try:
            return cls(**dict(values))
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> MoEConfig:
        """Load a config from a YAML file holding one flat mapping of field names to values.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the path is a directory, cannot be read, is not UTF-8 text or is larger than
                :data:`MAX_CONFIG_BYTES`; the YAML does not parse, repeats a key, is not a mapping, or fails
                :meth:`from_dict`. The message names the file.
        """
        path = Path(path)
        values = load_yaml_mapping_text(_read_config_text(path), str(path))
        if values is None:
            raise ValueError(f"{path}: the file is empty; expected a mapping of field names to values")
        return cls.from_dict(values, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict of all fields (round-trips through :meth:`from_dict` and YAML/JSON)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- derived sizes -----------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        """``torch.dtype`` named by :attr:`dtype`."""
        return CONFIG_DTYPES[self.dtype]

    @property
    def ranks_per_node(self) -> int:
        """``world_size // nodes``: ranks (GPUs) per node on Ray."""
        return self.world_size // self.nodes

    @property
    def local_experts(self) -> int:
        """``L = experts // world_size``, experts held by each rank."""
        return self.experts // self.world_size

    @property
    def w1_cols(self) -> int:
        """Columns of ``w1``: ``2 * ffn`` for swiglu (gate then up half), else ``ffn``."""
        return 2 * self.ffn if self.activation == "swiglu" else self.ffn

    def expert_range(self, rank: int) -> range:
        """Global expert indices ``[rank * L, (rank + 1) * L)`` owned by ``rank``."""
        _check_rank(self, rank)
        return range(rank * self.local_experts, (rank + 1) * self.local_experts)

    # -- seeded data (see the module functions) ----------------------------------------------

    def make_weights(self, seed: int | None = None, *, experts: Iterable[int] | None = None,
                     device: torch.device | str | None = None):
        """Same as :func:`make_weights` with this config."""
        return make_weights(self, seed, experts=experts, device=device)

    def make_tokens(self, rank: int, step: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Same as :func:`make_tokens` with this config."""
        return make_tokens(self, rank, step, device=device)


def _positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}): expected null or a number of seconds > 0")
    try:
        seconds = float(value)
    except OverflowError:  # an integer beyond float range
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name}={value!r}: expected null or a finite number of seconds > 0")
    return seconds


def _check_rank(config: MoEConfig, rank: int) -> None:
    if not _is_int(rank) or not 0 <= rank < config.world_size:
        raise ValueError(f"rank={rank!r}: expected an integer in [0, world_size={config.world_size})")


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed derived from ``seed`` and labels (e.g. ``"w1", expert``).

    Hashing keeps the streams for different tensors, experts, ranks and steps independent, and
    lets any of them be generated alone.
    """
    text = ":".join(str(part) for part in (seed, *labels))
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_SEED


def seeded_randn(shape: tuple[int, ...], seed: int, *, scale: float = 1.0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """``randn(shape) * scale`` drawn on the CPU in float32 from ``seed``, then cast and moved.

    Drawing on the CPU makes the numbers identical on every device and torch build.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return values.to(dtype=dtype, device=device).contiguous()


def make_weights(config: MoEConfig, seed: int | None = None, *, experts: Iterable[int] | None = None,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded layer weights, scaled so outputs are O(1) for unit-variance tokens.

    Args:
        config: the layer.
        seed: overrides ``config.seed``.
        experts: global expert indices to build ``w1``/``w2`` for (default all ``E``); a rank's
            shard is ``config.expert_range(rank)``, equal to slicing the global tensors.
        device: where to put the tensors (default CPU).

    Returns:
        ``router_weight [E, H]``, ``w1 [n, H, w1_cols]``, ``w2 [n, I, H]`` in ``config.torch_dtype``,
        with ``n = len(experts)``: entries are ``randn / sqrt(fan_in)``.
    """
    seed = config.seed if seed is None else seed
    if not _is_int(seed) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed!r}: expected an integer in [0, 2**63 - 1]")
    expert_indices = list(range(config.experts)) if experts is None else list(experts)
    for index in expert_indices:
        if not _is_int(index) or not 0 <= index < config.experts:
            raise ValueError(f"experts: index {index!r} out of range; expected 0 <= index < {config.experts}")
    hidden, ffn, dtype = config.hidden, config.ffn, config.torch_dtype

    router_weight = seeded_randn((config.experts, hidden), derive_seed(seed, "router"),
                                 scale=1 / math.sqrt(hidden), dtype=dtype, device=device)

    def stack(blocks: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        if not blocks:
            return torch.empty((0, *shape), dtype=dtype, device=device)
        return torch.stack(blocks).contiguous()

    w1 = stack([seeded_randn((hidden, config.w1_cols), derive_seed(seed, "w1", index),
                             scale=1 / math.sqrt(hidden), dtype=dtype, device=device)
                for index in expert_indices], (hidden, config.w1_cols))
    w2 = stack([seeded_randn((ffn, hidden), derive_seed(seed, "w2", index),
                             scale=1 / math.sqrt(ffn), dtype=dtype, device=device)
                for index in expert_indices], (ffn, hidden))
    return router_weight, w1, w2


def make_tokens(config: MoEConfig, rank: int, step: int, *,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Seeded tokens of ``rank`` at ``step``: ``x [tokens_per_rank, H]``, standard normal, config dtype."""
    _check_rank(config, rank)
    if not _is_int(step) or step < 0:
        raise ValueError(f"step={step!r}: expected an integer >= 0")
    return seeded_randn((config.tokens_per_rank, config.hidden), derive_seed(config.seed, "tokens", rank, step),
                        dtype=config.torch_dtype, device=device)
