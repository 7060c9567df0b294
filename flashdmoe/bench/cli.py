"""``flashdmoe bench``: argument parsing and the run that ties suites, timing and reports together.

Entry points: ``configure_parser(parser)`` adds the options to an argparse (sub)parser,
``run(args) -> int`` runs them, ``main(argv)`` does both (``python -m flashdmoe.bench``).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import shlex
import sys
from collections.abc import Sequence

import torch
from rich.console import Console

from flashdmoe.bench import report
from flashdmoe.bench.results import BenchConfig, parse_configs
from flashdmoe.bench.registry import SUITES, get_suite
from flashdmoe.bench.suite import Suite, SuiteOptions
from flashdmoe.bench.workload import DTYPES
from flashdmoe.outputs import OutputWriteError, check_output_dir

DEFAULT_OUTPUT_DIR = "results/bench"
QUICK_MAX_INPUT_SETS = 4
ACTIVATION_CHOICES = ("relu", "gelu", "silu", "swiglu")
CPU_QUICK_NOTE = "on the CPU the suite runs its quick shapes (a smoke test of the pipeline, not a measurement)"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (a top-level parser or a subcommand's)."""
    parser.add_argument(
        "--suite", default="single-gpu",
        help=f"suite to run ({', '.join(SUITES)}; default: single-gpu)",
    )
    parser.add_argument(
        "--output", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
        help=f"directory for <suite>.json, <suite>.md and <suite>.png, checked before the suite runs "
             f"(default: {DEFAULT_OUTPUT_DIR})",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per entry (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed warm-up runs per entry (default: 5)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None,
        help="where to run (default: cuda when available, else cpu)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true",
        help="tiny shapes (seconds on a CPU): a smoke test of the whole pipeline, not a measurement; the "
             "default on the CPU",
    )
    size.add_argument(
        "--full", action="store_true",
        help="the suite's full-size shapes even on the CPU (minutes to hours there); the default on a GPU",
    )
    parser.add_argument(
        "--configs", default=None, metavar="'T,H,I,E,k[,act];...' or NAME",
        help="shapes to run instead of the suite's (e.g. '8192,2048,2048,32,2;1,2048,768,128,8,swiglu'; "
             "single-gpu and training: an entry's own activation, when given, overrides --activation; expert-parallel: T is "
             "the total over all ranks), or a named set: single-gpu: targets (the 13 shapes of the forward "
             "targets, gelu and swiglu), targets-gelu, targets-swiglu",
    )
    parser.add_argument(
        "--entries", default=None, metavar="NAME,...",
        help="comma-separated entries to run (single-gpu: fused,fused_graph,grouped_mm,per_expert_loop,reference; "
             "expert-parallel: single,emulated-1,emulated-2,emulated-4,emulated-8,mps-2,mps-4,reference; "
             "training: flashdmoe,flashdmoe_graph,grouped_mm)",
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="input dtype (default: the suite's, bfloat16)"
    )
    parser.add_argument(
        "--activation", choices=ACTIVATION_CHOICES, default=None,
        help="expert activation (default: the suite's, gelu; training: each shape's own)",
    )
    parser.add_argument(
        "--reference-max-tokens", type=int, default=None, metavar="T",
        help="skip timing the reference loop on shapes with more than T tokens (default: never skip)",
    )
    parser.add_argument(
        "--input-sets", type=int, default=None, metavar="N",
        help="input sets rotated between runs (default: enough to exceed twice the L2 cache)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    return parser


def _quick_by_default(args: argparse.Namespace, device: str) -> bool:
    """Full-size shapes take many minutes to hours on a CPU: there the quick ones run unless --full or
    --configs asks for others."""
    return device == "cpu" and not args.quick and not args.full and not args.configs


def _positive(name: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{name} {value}: expected an integer >= {minimum}")


def _configs(suite: Suite, text: str) -> list[BenchConfig]:
    """``--configs``: one of the suite's named sets, or parsed entries. Raises ValueError."""
    if text.strip() in suite.named_configs:
        return list(suite.named_configs[text.strip()])
    if "," not in text:  # not a shape: a name
        named = sorted(suite.named_configs) or "none"
        raise ValueError(f"--configs {text!r}: expected 'T,H,I,E,k[,activation];...' or a named set of the "
                         f"{suite.name} suite ({named})")
    configs = parse_configs(text)
    if not suite.per_config_activation:
        own = next((config for config in configs if config.activation), None)
        if own is not None:
            raise ValueError(f"--configs: the {suite.name} suite takes no activation per entry (got "
                             f"{own.activation!r}); expected T,H,I,E,k entries and --activation")
    return configs


def options_from_args(args: argparse.Namespace, console: Console) -> SuiteOptions:
    """Validate the parsed options and resolve the suite's defaults. Raises ValueError."""
    suite = get_suite(args.suite)
    _positive("--repeats", args.repeats, 1)
    _positive("--warmup", args.warmup, 0)
    _positive("--reference-max-tokens", args.reference_max_tokens, 0)
    _positive("--input-sets", args.input_sets, 1)
    device = args.device or _default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    quick = args.quick or _quick_by_default(args, device)
    shape_activations: tuple[str | None, ...] = ()
    if args.configs:
        configs = _configs(suite, args.configs)
        shapes = [config.shape for config in configs]
        if any(config.activation for config in configs):
            shape_activations = tuple(config.activation for config in configs)
    else:
        shapes = list(suite.quick_shapes if quick else suite.default_shapes)
        if quick and not args.quick:
            console.print(f"flashdmoe bench: {CPU_QUICK_NOTE}; --full runs the full-size shapes, --configs your own",
                          markup=False, highlight=False)
    if args.entries:
        entries = [name.strip() for name in args.entries.split(",") if name.strip()]
        unknown = [name for name in entries if name not in suite.entry_names]
        if unknown or not entries:
            raise ValueError(
                f"--entries {args.entries!r}: expected a comma-separated subset of {list(suite.entry_names)}"
            )
    else:
        entries = list(suite.entry_names)
    options = SuiteOptions(
        suite=suite.name,
        device=device,
        dtype=args.dtype or suite.dtype,
        activation=args.activation or suite.activation,
        shapes=shapes,
        entries=entries,
        repeats=args.repeats,
        warmup=args.warmup,
        reference_max_tokens=args.reference_max_tokens,
        input_sets=args.input_sets,
        # A smoke test needs the rotation exercised, not a cold cache: a few sets are enough.
        max_input_sets=QUICK_MAX_INPUT_SETS if quick else SuiteOptions.max_input_sets,
        seed=args.seed,
        console=console,
        shape_activations=shape_activations,
    )
    if suite.validate is not None:
        suite.validate(options)
    return options


def run(args: argparse.Namespace) -> int:
    """Run the suite named by ``args`` and write its reports.

    Returns 0 when every entry that ran is within its error tolerance, 1 when an entry failed or
    exceeded it (results are still written), 2 for bad options or an ``--output`` that cannot take the
    reports (checked before the suite runs), 3 when the reports could not be written (the table is
    printed first; no partial file is left).
    """
    console = Console(stderr=True, log_path=False)
    try:
        check_output_dir(args.output)
        options = options_from_args(args, console)
    except ValueError as error:
        console.print(f"flashdmoe bench: {error}", style="red", markup=False, highlight=False)
        return 2
    suite = get_suite(options.suite)
    started = datetime.datetime.now(datetime.timezone.utc)
    result = suite.runner(options)
    result.date = started.isoformat(timespec="seconds")
    result.command = getattr(args, "command_line", None) or _command_line(sys.argv)
    if _quick_by_default(args, options.device):
        result.settings.setdefault("notes", []).append(CPU_QUICK_NOTE + "; --full runs the full-size shapes")
    # The table first, on stdout: whatever happens to the files, the numbers are in the log.
    report.print_summary(result, Console(), suite.layout)
    failures = [
        f"{config.label} / {entry.label}"
        for config in result.configs
        for entry in config.entries
        if entry.status == "error" or entry.correct is False
    ]
    if failures:
        console.print("failed or out of tolerance: " + "; ".join(failures), style="red", markup=False,
                      highlight=False)
    try:
        paths = report.write_all(result, args.output, suite.layout)
    except OutputWriteError as error:
        console.print(f"flashdmoe bench: the reports could not be written: {error}; nothing was left "
                      "half-written (the table above has the results)", style="red", markup=False, highlight=False)
        return 3
    console.print("wrote " + ", ".join(str(path) for path in paths.values()), markup=False, highlight=False)
    return 1 if failures else 0


def _command_line(argv: Sequence[str]) -> str:
    """The command as a user would retype it (``python -m flashdmoe.bench`` or ``flashdmoe bench``)."""
    if not argv:
        return "flashdmoe bench"
    path = pathlib.Path(argv[0])
    if path.name == "__main__.py":  # python -m flashdmoe (the CLI) or python -m flashdmoe.bench
        module = "flashdmoe.bench" if path.parent.name == "bench" else "flashdmoe"
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join([path.name, *argv[1:]])


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser(
        argparse.ArgumentParser(
            prog="flashdmoe bench",
            description="Time the fused MoE kernel beside unfused baselines (docs/design.md §12).",
        )
    )
    args = parser.parse_args(argv)
    if argv is not None:
        args.command_line = shlex.join(["flashdmoe", "bench", *argv])
    return run(args)
