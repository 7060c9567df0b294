"""Facts about the machine and its measured peaks (tensor-core ceiling, copy bandwidth).

Peaks are measured in the same run as the entries they judge, so a throttled or shared GPU shows
up in the ceiling too instead of flattering the percentages.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
from typing import TYPE_CHECKING

import torch

from flashdmoe.bench.timing import TimingStats, measure

if TYPE_CHECKING:
    from rich.console import Console

CEILING_MATMUL_SIZE = 8192
GPU_COPY_BYTES = 1024 * 1024 * 1024
CPU_COPY_BYTES = 64 * 1024 * 1024


def machine_info(device: torch.device | str) -> dict[str, object]:
    """Host, Python, torch and (for CUDA) GPU facts for the results file."""
    device = torch.device(device)
    info: dict[str, object] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": str(device),
        "gpu_name": None,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info["gpu_name"] = properties.name
        info["gpu_memory_bytes"] = int(properties.total_memory)
        info["gpu_multiprocessors"] = int(properties.multi_processor_count)
        info["gpu_capability"] = f"{properties.major}.{properties.minor}"
        info["gpu_l2_bytes"] = getattr(properties, "L2_cache_size", None)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def sm_clock_mhz(device: torch.device | str) -> int | None:
    """The GPU's SM clock in MHz as the driver last sampled it (an average over its last 1/6 to 1 s), or None
    off CUDA or where it cannot be read. Through NVML (``torch.cuda.clock_rate``, needs ``pynvml``), else
    ``nvidia-smi`` when it and torch see one GPU each (so that the two name the same one)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - no pynvml or no NVML: try nvidia-smi
        pass
    if torch.cuda.device_count() != 1 or shutil.which("nvidia-smi") is None:
        return None
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(answer[0]) if len(answer) == 1 and answer[0].isdigit() else None


def measure_matmul_ceiling(
    device: torch.device | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    size: int = CEILING_MATMUL_SIZE,
    warmup: int = 5,
    repeats: int = 20,
) -> tuple[float, TimingStats]:
    """Median TFLOP/s of a ``size``^3 matmul in ``dtype`` (the tensor-core ceiling on a GPU).

    Returns (tflops, stats). Two operand pairs are rotated (2 x 3 x 128 MiB at 8192^3 bf16).
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(1234)
    operands = [
        (
            torch.randn(size, size, device=device, dtype=dtype, generator=generator),
            torch.randn(size, size, device=device, dtype=dtype, generator=generator),
            torch.empty(size, size, device=device, dtype=dtype),
        )
        for _ in range(2)
    ]
    runs = [lambda a=a, b=b, c=c: torch.mm(a, b, out=c) for a, b, c in operands]
    stats = measure(runs, device=device, warmup=warmup, repeats=repeats)
    tflops = 2.0 * size**3 / (stats.median_ms * 1e-3) / 1e12
    return tflops, stats


def suite_matmul_ceiling(device: torch.device | str, console: Console) -> float | None:
    """The ``ceiling_tflops`` a suite reports: the bf16 matmul ceiling measured on a CUDA device (logged on
    ``console``, it takes a while), None on any other device (the tensor-core ceiling is a GPU measurement).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    console.log(f"measuring the bf16 matmul ceiling ({CEILING_MATMUL_SIZE}^3) on {device}")
    return measure_matmul_ceiling(device)[0]


def measure_copy_bandwidth(
    device: torch.device | str,
    *,
    copy_bytes: int | None = None,
    warmup: int = 3,
    repeats: int = 20,
) -> tuple[float, TimingStats]:
    """Median bytes/s of a large same-device copy, counting the read and the write.

    Returns (bytes_per_second, stats).
    """
    device = torch.device(device)
    if copy_bytes is None:
        copy_bytes = GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    elements = copy_bytes // 4
    generator = torch.Generator(device=device).manual_seed(4321)
    source = torch.randn(elements, device=device, dtype=torch.float32, generator=generator)
    destination = torch.empty_like(source)
    stats = measure(
        [lambda: destination.copy_(source)], device=device, warmup=warmup, repeats=repeats
    )
    moved_bytes = 2 * source.numel() * source.element_size()
    return moved_bytes / (stats.median_ms * 1e-3), stats
