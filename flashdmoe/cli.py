"""The ``flashdmoe`` command line: ``info``, ``run``, ``bench``, ``build``.

``flashdmoe run`` opens the ranks (:class:`ray_actors.cluster.MoECluster`, one Ray worker per rank, or
with ``--in-process`` :class:`flashdmoe.job.InProcessRanks`) and runs the main job on them
(:func:`flashdmoe.job.run_job`); it is also the ``ray job submit`` entrypoint. Ray is imported only for a
Ray run, so the other commands and ``--in-process`` work where Ray is absent.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["build_parser", "collect_info", "main"]

# `flashdmoe run` exit status: 1 when the result is not a verified one (verification failed, or a
# fault the bounded retries could not recover), 2 for bad input, an output location that cannot take the
# results, or a cluster that cannot host the run (before any step runs), 3 when the run finished but its
# results could not be written (the table is printed first), 130 when interrupted.
_EXIT_BAD_INPUT = 2
_EXIT_VERIFICATION_FAILED = 1
_EXIT_RUN_FAILED = 1
_EXIT_NOT_WRITTEN = 3
_EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that SIGINT ended


def _package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# -- info ------------------------------------------------------------------------------------------


def _nvcc_info() -> dict[str, Any]:
    candidates = [shutil.which("nvcc")]
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            candidates.append(str(Path(os.environ[variable]) / "bin" / "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            try:
                output = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError) as error:
                return {"path": candidate, "version": None, "error": _error_text(error)}
            match = re.search(r"release ([\d.]+)", output)
            return {"path": candidate, "version": match.group(1) if match else output.strip() or None}
    return {"path": None, "version": None}


def _nvshmem_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "nvshmem4py": _package_version("nvshmem4py-cu13"),
        "nvidia_nvshmem": _package_version("nvidia-nvshmem-cu13"),
        "core_importable": False,
        "lib_dir": None,
    }
    if importlib.util.find_spec("nvshmem") is not None:
        try:
            importlib.import_module("nvshmem.core")
            info["core_importable"] = True
        except Exception as error:  # a broken install must not break `info`
            info["import_error"] = _error_text(error)
    # The nvidia-nvshmem wheel ships versioned libs under nvidia/nvshmem/lib (a namespace package).
    nvidia_spec = importlib.util.find_spec("nvidia")
    for location in (nvidia_spec.submodule_search_locations or []) if nvidia_spec else []:
        lib_dir = Path(location) / "nvshmem" / "lib"
        if lib_dir.is_dir():
            info["lib_dir"] = str(lib_dir)
            break
    return info


def _host_module_state() -> str:
    """Where the host module is built for this torch and source tree, or that it is not built yet (it is
    built by the first fused forward, or ``flashdmoe build --host``); nothing is built here."""
    try:
        host_queue = importlib.import_module("flashdmoe.kernel.host_queue")
        built = sorted(host_queue.build_dir().glob(f"{host_queue.MODULE_NAME}*.so"))
    except Exception as error:
        return f"unknown: {_error_text(error)}"
    return str(built[-1]) if built else "not built yet (flashdmoe build --host)"


def _extension_info() -> dict[str, Any]:
    try:
        extension = importlib.import_module("flashdmoe.kernel.extension")
    except Exception as error:
        return {"available": False, "reason": f"flashdmoe.kernel.extension cannot be imported: {_error_text(error)}"}
    try:
        build = extension.kernel_build()
    except ValueError as error:
        build = f"invalid: {error}"
    # The NVSHMEM build (what a team across nodes runs) needs NVSHMEM's device and host libraries.
    nvshmem_problem = extension.nvshmem_problem()
    builds = {"kernel_build": build, "nvshmem_build": "buildable" if nvshmem_problem is None else nvshmem_problem,
              "host_module": _host_module_state()}
    try:
        available = bool(extension.available())
        return {"available": available, "reason": None if available else extension.unavailable_reason(), **builds}
    except Exception as error:
        return {"available": False, "reason": _error_text(error), **builds}


def collect_info() -> dict[str, Any]:
    """Versions and hardware as a JSON-serialisable dict (works without a GPU)."""
    import torch

    from flashdmoe import __version__

    devices = []
    cuda_available = torch.cuda.is_available()
    if cuda_available:
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            devices.append({
                "index": index,
                "name": properties.name,
                "capability": f"{properties.major}.{properties.minor}",
                "memory_gib": round(properties.total_memory / 2**30, 1),
                "multiprocessors": properties.multi_processor_count,
            })
    return {
        "flashdmoe": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda_available,
        "devices": devices,
        "nvcc": _nvcc_info(),
        "nvshmem": _nvshmem_info(),
        "cutlass": _package_version("nvidia-cutlass"),
        "extension": _extension_info(),
        "ray": _package_version("ray"),
    }


def _print_info(info: dict[str, Any], console: Console) -> None:
    def shown(value: Any) -> str:
        return "not found" if value is None else str(value)

    table = Table(title="flashdmoe info", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("flashdmoe", info["flashdmoe"])
    table.add_row("python", f"{info['python']} ({info['platform']})")
    table.add_row("torch", f"{info['torch']} (built for CUDA {shown(info['torch_cuda'])})")
    table.add_row("CUDA available", "yes" if info["cuda_available"] else "no")
    if info["devices"]:
        for device in info["devices"]:
            table.add_row(f"GPU {device['index']}",
                          f"{device['name']}, sm_{device['capability'].replace('.', '')}, "
                          f"{device['memory_gib']} GiB, {device['multiprocessors']} SMs")
    else:
        table.add_row("GPUs", "none visible")
    nvcc = info["nvcc"]
    table.add_row("nvcc", f"{nvcc['version']} ({nvcc['path']})" if nvcc["path"] else "not found")
    nvshmem = info["nvshmem"]
    core = "importable" if nvshmem["core_importable"] else nvshmem.get("import_error", "not importable")
    table.add_row("nvshmem4py", f"{shown(nvshmem['nvshmem4py'])}; nvshmem.core {core}")
    table.add_row("NVSHMEM libs", f"{shown(nvshmem['nvidia_nvshmem'])} ({shown(nvshmem['lib_dir'])})")
    table.add_row("CUTLASS (nvidia-cutlass)", shown(info["cutlass"]))
    extension = info["extension"]
    table.add_row("CUDA extension", "available" if extension["available"] else f"unavailable: {extension['reason']}")
    if "kernel_build" in extension:
        table.add_row("kernel build", f"{extension['kernel_build']} (FLASHDMOE_KERNEL_BUILD; NVSHMEM build: "
                                      f"{extension['nvshmem_build']})")
    if "host_module" in extension:
        table.add_row("host module", extension["host_module"])
    table.add_row("ray", shown(info["ray"]))
    console.print(table)


def _command_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info, Console())
    return 0


# -- run -------------------------------------------------------------------------------------------


def _load_run_config(args: argparse.Namespace):
    """The validated config with ``--workers`` applied; raises ValueError/FileNotFoundError before any
    Ray process or actor starts."""
    from flashdmoe.config import MoEConfig

    config = MoEConfig.from_yaml(args.config)
    if args.workers is not None:
        try:
            config = config.replace(world_size=args.workers)
        except ValueError as error:
            raise ValueError(f"--workers={args.workers}: {error}") from None
    return config


#: ``flashdmoe run`` options that apply to Ray runs only, with their ``MoECluster`` argument names.
_RAY_OPTIONS = {"address": "--address", "gpus_per_worker": "--gpus-per-worker", "max_retries": "--max-retries",
                "mps_pipe_dir": "--mps-pipe-dir", "mps_log_dir": "--mps-log-dir",
                "placement_timeout": "--placement-timeout", "connect_timeout": "--connect-timeout"}


def _check_run_options(args: argparse.Namespace) -> None:
    """Options that cannot go together, and values argparse lets through; raises ValueError."""
    if args.in_process:
        for name, option in _RAY_OPTIONS.items():
            value = getattr(args, name)
            if value is not None:
                raise ValueError(f"{option}={value!r}: applies to runs on Ray; --in-process runs every rank in this "
                                 f"process (drop {option} or --in-process)")
    elif args.device is not None:
        raise ValueError(f"--device={args.device!r}: applies to --in-process runs only; each Ray worker uses "
                         "its own GPU (or the CPU)")
    for name, option in (("connect_timeout", "--connect-timeout"), ("placement_timeout", "--placement-timeout")):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{option}={value!r}: expected a number of seconds > 0")


def _in_process_device(args: argparse.Namespace):
    """The torch device of an --in-process run: --device checked, else cuda when usable, else cpu."""
    import torch

    if args.device is None:
        return torch.device("cuda" if args.backend != "reference" and torch.cuda.is_available() else "cpu")
    expected = "expected cpu, cuda or cuda:INDEX"
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device={args.device!r}: not a device; {expected}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device={args.device!r}: {expected}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device={args.device!r}: no CUDA device is visible to torch here; use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device={args.device!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _check_memory(args: argparse.Namespace, config, device) -> None:
    """Refuse sizes this machine cannot hold before anything is allocated (flashdmoe.job.preflight)."""
    import torch

    from flashdmoe.job import preflight

    if args.in_process:
        preflight.check_memory(config, verify=args.verify, in_process=True, device=device)
        return
    per_gpu = preflight.ranks_per_gpu(args.gpus_per_worker)
    gpu_workers = args.backend == "cuda" or (
        args.backend == "auto" and config.dtype != "float32" and torch.cuda.is_available()
        and torch.cuda.device_count() * per_gpu >= config.world_size)
    local = args.address is None and not os.environ.get("RAY_ADDRESS")
    preflight.check_memory(config, verify=args.verify, in_process=False, local_ray=local, gpu_workers=gpu_workers,
                           ranks_per_gpu=per_gpu)


def _open_ranks(args: argparse.Namespace, config, device):
    """The run's executor, started: every rank in this process (``--in-process``) or one Ray worker each."""
    if args.in_process:
        from flashdmoe.job import InProcessRanks

        return InProcessRanks(config, backend=args.backend, device=device)
    try:
        from ray_actors.cluster import MoECluster
    except ImportError as error:
        raise ValueError(f"the Ray run cannot start: {error}; install ray[default] (pip install -e .) or "
                         "pass --in-process to run every rank in this process without Ray") from None
    options = {name: getattr(args, name) for name in ("gpus_per_worker", "max_retries", "mps_pipe_dir", "mps_log_dir")
               if getattr(args, name) is not None}
    if args.placement_timeout is not None:
        options["placement_timeout_s"] = args.placement_timeout
    # _command_run has checked --address within --connect-timeout: the cluster need not probe it again
    return MoECluster(config, args.address, backend=args.backend, check_address=False, **options)


def _command_run(args: argparse.Namespace) -> int:
    from flashdmoe.job import ClusterTooSmall, WorkerFault, preflight, run_job
    from flashdmoe.job.results import StepLog
    from flashdmoe.job.table import default_console
    from flashdmoe.outputs import OutputWriteError, check_output_dir

    # Everything that can be checked here is, in this order, before a Ray process, a worker or a tensor.
    _check_run_options(args)
    device = _in_process_device(args) if args.in_process else None
    config = _load_run_config(args)
    check_output_dir(args.output)
    _check_memory(args, config, device)
    if not args.in_process:
        preflight.check_ray_address(args.address, timeout_s=args.connect_timeout or preflight.DEFAULT_CONNECT_TIMEOUT_S,
                                    notice=lambda text: print(f"flashdmoe run: {text}", file=sys.stderr, flush=True))
    try:
        ranks = _open_ranks(args, config, device)
    except ClusterTooSmall as error:
        print(f"error: the cluster cannot host the run: {error}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    except ConnectionError as error:  # Ray could not join the cluster after all
        print(f"error: cannot join the Ray cluster: {error}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    except WorkerFault as fault:  # the workers could not be started within the bounded retries
        print(f"error: the workers did not start ({fault.kind} on rank(s) {fault.ranks}): {fault}", file=sys.stderr)
        return _EXIT_RUN_FAILED
    log = None
    try:
        with ranks:
            try:
                log = StepLog(args.output)
            except OutputWriteError as error:
                print(f"error: --output {args.output}: {error}", file=sys.stderr)
                return _EXIT_BAD_INPUT
            with log:
                results = run_job(ranks, verify=args.verify, output_dir=args.output, progress=not args.no_progress,
                                  console=default_console(), on_step=log.append)
    except WorkerFault as fault:  # the team broke and the bounded retries did not bring it back
        kept = f" (the steps finished before it are in {log.path})" if log is not None and not log.error else ""
        print(f"error: the run failed ({fault.kind} on rank(s) {fault.ranks}): {fault}{kept}", file=sys.stderr)
        return _EXIT_RUN_FAILED
    except OutputWriteError as error:
        kept = "" if log is None or log.error else f"; {log.path} has every step"
        print(f"error: the run finished but its results could not be written: {error}; nothing was left half-written "
              f"(the table above has the results{kept})", file=sys.stderr)
        return _EXIT_NOT_WRITTEN
    verification = results["verification"]
    if verification["enabled"] and not verification["passed"]:
        return _EXIT_VERIFICATION_FAILED
    return 0


# -- build -----------------------------------------------------------------------------------------


def _command_build(args: argparse.Namespace) -> int:
    from flashdmoe.kernel import extension, host_queue

    if args.host:
        try:
            print(host_queue.module().__file__)
        except extension.BuildError as error:
            print(f"error: build failed: {error}", file=sys.stderr)
            return 1
        return 0
    builder = extension.build_nvshmem if args.nvshmem else extension.build
    try:
        path = builder(arch=args.arch, force=args.force, verbose=args.verbose)
    except extension.BuildError as error:
        print(f"error: build failed: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


# -- bench -----------------------------------------------------------------------------------------


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    description = "Benchmark suites (see docs/benchmarks.md)."
    try:
        bench = importlib.import_module("flashdmoe.bench")
        configure_parser, run = bench.configure_parser, bench.run
    except Exception as error:  # keep info/run/build usable if the bench suites are broken or absent
        reason = _error_text(error)
        # prefix_chars no user types: every word, options included, lands in `rest`, so any bench
        # command line reaches the handler that explains why bench is unavailable.
        parser = subparsers.add_parser("bench", help="benchmark suites (unavailable here)", add_help=False,
                                       prefix_chars="\x01", description=f"{description} Unavailable: {reason}")
        parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)

        def unavailable(_: argparse.Namespace) -> int:
            print(f"error: flashdmoe bench is unavailable: {reason}", file=sys.stderr)
            return _EXIT_BAD_INPUT

        parser.set_defaults(handler=unavailable)
        return
    parser = subparsers.add_parser("bench", help="benchmark suites", description=description)
    configure_parser(parser)
    parser.set_defaults(handler=run)


# -- parser ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``flashdmoe`` argument parser with its subcommands."""
    from flashdmoe import __version__

    parser = argparse.ArgumentParser(
        prog="flashdmoe",
        description="FlashDMoE: a distributed Mixture-of-Experts layer as one persistent GPU kernel per GPU.",
    )
    parser.add_argument("--version", action="version", version=f"flashdmoe {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = subparsers.add_parser("info", help="versions, GPUs, NVSHMEM and extension status",
                                 description="Show versions, GPUs, nvcc, NVSHMEM and the CUDA extension's status.")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(handler=_command_info)

    run = subparsers.add_parser(
        "run", help="the main job: forward + backward steps of a configured layer on Ray workers",
        description="Run config.steps forward + backward steps of the layer on world_size Ray workers (one rank "
                    "each; without --address an embedded Ray on 127.0.0.1), verify step 0's outputs and gradients "
                    "against a float64 reference, print a table and write results.json and latency.png. "
                    "--in-process runs the ranks inside this process instead (no Ray). Exit status: 0 success, "
                    "1 verification failed or the team could not be recovered, 2 bad config or argument, an "
                    "--output that cannot take the results, sizes this machine cannot hold, or a cluster that "
                    "does not answer or cannot host the run (before any step runs), 3 the run finished but "
                    "results.json or latency.png could not be written (the table is printed first), 130 "
                    "interrupted.",
    )
    run.add_argument("--config", required=True, type=Path, help="YAML config (see configs/)")
    run.add_argument("--output", type=Path, default=Path("results"),
                     help="directory for results.json, latency.png and steps.jsonl (one line per step as the "
                          "run goes); checked before the run starts (default: results/)")
    run.add_argument("--address", default=None,
                     help="Ray cluster to join, e.g. 'auto' (the cluster of this node or of the Ray job) or "
                          "HOST:PORT (default: $RAY_ADDRESS, else an embedded Ray on 127.0.0.1); it must answer "
                          "within --connect-timeout")
    run.add_argument("--workers", type=int, default=None,
                     help="number of ranks, one Ray worker each (default: the config's world_size)")
    run.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                     help="check step 0's outputs and gradients against the reference, in float64 on this "
                          "process's CPU (default: on; use --no-verify for large configs)")
    run.add_argument("--backend", choices=("auto", "reference", "cuda"), default="auto",
                     help="auto: the fused kernel where every worker has a GPU, else the reference; reference: "
                          "CPU expert parallelism over gloo (on Ray) or the reference layer (--in-process); "
                          "cuda: the fused kernel (default: auto)")
    run.add_argument("--gpus-per-worker", type=float, default=None,
                     help="GPU share per worker on the cuda backend, in (0, 1] (the actors' num_gpus); below 1 "
                          "ranks share a GPU under MPS, each with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="
                          "floor(100*share); start the MPS daemon first (docs/deploy.md) (default: 1)")
    run.add_argument("--mps-pipe-dir", default=None,
                     help="the MPS daemon's pipe directory, given to every GPU worker as CUDA_MPS_PIPE_DIRECTORY "
                          "(default with --gpus-per-worker below 1: $CUDA_MPS_PIPE_DIRECTORY, if set)")
    run.add_argument("--mps-log-dir", default=None,
                     help="the MPS daemon's log directory, given to every GPU worker as CUDA_MPS_LOG_DIRECTORY "
                          "(default with --gpus-per-worker below 1: $CUDA_MPS_LOG_DIRECTORY, if set)")
    run.add_argument("--max-retries", type=int, default=None,
                     help="recoveries from a dead worker, a kernel watchdog (KernelTimeout) or a hung team "
                          "allowed per call (default: 2)")
    run.add_argument("--placement-timeout", type=float, default=None, metavar="SECONDS",
                     help="how long to wait for the Ray cluster to place the workers before giving up with exit "
                          "status 2 (default: 120)")
    run.add_argument("--connect-timeout", type=float, default=None, metavar="SECONDS",
                     help="how long to wait for the cluster of --address (or $RAY_ADDRESS) to answer before giving "
                          "up with exit status 2 (default: 5)")
    run.add_argument("--in-process", action="store_true",
                     help="run every rank inside this process (no Ray): the expert-parallel reference, or "
                          "flashdmoe.moe for one rank")
    run.add_argument("--device", default=None,
                     help="torch device for --in-process (default: cuda if available, else cpu)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.set_defaults(handler=_command_run)

    _add_bench(subparsers)

    build = subparsers.add_parser("build", help="build the CUDA extension ahead of time",
                                  description="Compile csrc/ into the flashdmoe_cuda extension and print its path.")
    build.add_argument("--arch", default=None,
                       help="GPU architecture, e.g. sm_90a (default: $FLASHDMOE_CUDA_ARCH, the GPU's, else sm_90a)")
    build.add_argument("--force", action="store_true", help="rebuild even if a cached build matches")
    build.add_argument("--verbose", action="store_true", help="show the compiler commands")
    build.add_argument("--nvshmem", action="store_true",
                       help="build the NVSHMEM kernel build instead (flashdmoe_nvshmem: what a team across nodes "
                            "runs, FLASHDMOE_KERNEL_BUILD=nvshmem)")
    build.add_argument("--host", action="store_true",
                       help="build the host module instead (flashdmoe_host: C++ against this torch, no CUDA; the "
                            "fused forward's launch path)")
    build.set_defaults(handler=_command_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashdmoe`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    from flashdmoe.errors import BackendUnavailable
    from flashdmoe.interrupts import redeliver_dropped_interrupts

    try:
        # a Ctrl-C that lands in an at-fork callback of ray.init's process starts would be dropped
        with redeliver_dropped_interrupts():
            return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError, BackendUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the executors have stopped their workers (and an embedded Ray) on the way out
        print("interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED
