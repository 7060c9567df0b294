"""``flashdmoe bench``: end-to-end CPU smoke run, result schema, baselines against the reference,
metrics and timing statistics. Fast: tiny shapes, few repeats."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest
import torch
from rich.console import Console

from closeness import assert_normwise_close
from conftest import next_seed
from flashdmoe import numerics, reference
from flashdmoe.bench import (
    baselines,
    expert_parallel,
    hardware,
    main,
    metrics,
    rank_results,
    rank_scenarios,
    registry,
    report,
    kernel_profile,
    single_gpu,
    timing,
    workload,
)
from flashdmoe.bench import cli as bench_cli
from flashdmoe.bench.entries import ENTRY_TYPES, BenchEntry, MoEInputs, MoEProblem, PreparedRun
from flashdmoe.bench.results import BenchConfig, BenchShape, ConfigResult, EntryResult, SuiteResult, parse_configs
from flashdmoe.bench.suite import SuiteOptions
from flashdmoe.bench.workload import make_inputs
from flashdmoe.ranks import Problem, RankContext, RankOutcome, RunResult, run_ranks, scenarios
from flashdmoe.ranks.problem import expected_traffic, reference_results

QUICK_ARGS = ["--device", "cpu", "--quick", "--repeats", "3", "--warmup", "1"]
ENTRY_NAMES = ["fused", "fused_graph", "grouped_mm", "per_expert_loop", "reference"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``--device cpu --quick`` run of the single-gpu suite: (exit code, output dir, JSON)."""
    output = tmp_path_factory.mktemp("bench")
    code = main([*QUICK_ARGS, "--output", str(output)])
    return code, output, json.loads((output / "single-gpu.json").read_text())


def test_quick_run_writes_json_markdown_and_png(quick_run):
    code, output, results = quick_run
    assert code == 0
    assert (output / "single-gpu.png").read_bytes()[:8] == PNG_MAGIC
    markdown = (output / "single-gpu.md").read_text()
    assert "| T | H | I | E | k | floor ms | entry |" in markdown
    # one table row per (configuration, entry)
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(results["configs"]) * len(ENTRY_NAMES)
    assert results["command"].startswith("flashdmoe bench --device cpu --quick")
    assert results["machine"]["torch"] == torch.__version__
    assert results["date"]
    assert results["settings"]["repeats"] == 3 and results["settings"]["dtype"] == "bfloat16"
    assert results["copy_bandwidth_gbps"] > 0
    assert results["ceiling_tflops"] is None  # the tensor-core ceiling is a GPU measurement


def test_suite_matmul_ceiling_is_measured_on_cuda_only(monkeypatch):
    measured = []
    monkeypatch.setattr(hardware, "measure_matmul_ceiling", lambda device: measured.append(device) or (123.0, None))
    console = Console(record=True, width=200)
    assert hardware.suite_matmul_ceiling("cpu", console) is None and not measured
    assert hardware.suite_matmul_ceiling("cuda:1", console) == 123.0
    assert measured == [torch.device("cuda", 1)]
    assert "measuring the bf16 matmul ceiling (8192^3) on cuda:1" in console.export_text()


def test_every_config_has_every_entry_with_consistent_numbers(quick_run):
    _, _, results = quick_run
    assert [config["shape"] for config in results["configs"]] == [
        shape.to_dict() for shape in single_gpu.QUICK_SHAPES
    ]
    for config in results["configs"]:
        assert [entry["name"] for entry in config["entries"]] == ENTRY_NAMES
        assert config["compared_tokens"] + config["near_tie_tokens"] == config["shape"]["T"]
        assert config["floor_ms"] > 0
        assert config["input_sets"] == 4  # tiny sets: rotation capped at --quick's 4 sets
        timed = [entry for entry in config["entries"] if entry["status"] == "ok"]
        assert {"per_expert_loop", "reference"} <= {entry["name"] for entry in timed}
        for entry in timed:
            assert len(entry["samples_ms"]) == 3
            assert entry["p10_ms"] <= entry["median_ms"] <= entry["p90_ms"]
            assert entry["median_ms"] == pytest.approx(float(np.median(entry["samples_ms"])))
            assert entry["tflops"] == pytest.approx(config["flops"] / (entry["median_ms"] * 1e-3) / 1e12)
            assert entry["percent_of_floor"] == pytest.approx(100 * config["floor_ms"] / entry["median_ms"])
            assert entry["correct"] is True
            assert entry["max_relative_error"] <= entry["error_tolerance"] == numerics.kernel_tolerance("bfloat16")
        assert config["entries"][ENTRY_NAMES.index("reference")]["max_relative_error"] == 0.0  # against itself


def test_flop_count_matches_hand_computed_number(quick_run):
    _, _, results = quick_run
    first = results["configs"][0]
    assert first["shape"] == {"T": 64, "H": 64, "I": 128, "E": 8, "k": 2}
    # 2*T*k*H*I*2 (two expert GEMMs) + 2*T*H*E (router) = 4194304 + 65536
    assert first["flops"] == 4_259_840
    # swiglu: three expert GEMMs' worth. T=3 H=4 I=5 E=6 k=2: 2*3*2*4*5*3 + 2*3*4*6 = 720 + 144
    assert metrics.moe_flops(3, 4, 5, 6, 2, "swiglu") == 864
    assert metrics.moe_flops(3, 4, 5, 6, 2, "relu") == 2 * 3 * 2 * 4 * 5 * 2 + 144


def test_bytes_floor_counts_active_experts_once_plus_activations():
    # 3 active experts x (H*I + I*H) bf16 + x and y (T*H each); swiglu's W1 is twice as wide
    assert metrics.bytes_floor(3, 10, 4, 5, "gelu", 2) == 3 * (20 + 20) * 2 + 2 * 10 * 4 * 2
    assert metrics.bytes_floor(3, 10, 4, 5, "swiglu", 2) == 3 * (40 + 20) * 2 + 2 * 10 * 4 * 2
    assert metrics.active_expert_count(torch.tensor([[0, 5], [5, 2], [0, 2]])) == 3


def test_fused_entry_reported_unavailable_with_reason_on_cpu(quick_run):
    _, output, results = quick_run
    for config in results["configs"]:
        fused = config["entries"][0]
        assert fused["status"] == "unavailable"
        assert "cuda" in fused["reason"].lower()
        assert fused["median_ms"] is None and fused["samples_ms"] == []
    assert "unavailable: " in (output / "single-gpu.md").read_text()


@pytest.mark.skipif(not baselines.grouped_mm_available(), reason="this torch has no torch._grouped_mm")
def test_grouped_mm_entry_runs_on_cpu_and_is_the_speedup_baseline(quick_run):
    _, _, results = quick_run
    for config in results["configs"]:
        grouped = config["entries"][ENTRY_NAMES.index("grouped_mm")]
        assert grouped["status"] == "ok", grouped["reason"]
        assert grouped["speedup_over_grouped_mm"] == pytest.approx(1.0)
        loop = config["entries"][ENTRY_NAMES.index("per_expert_loop")]
        assert loop["speedup_over_grouped_mm"] == pytest.approx(grouped["median_ms"] / loop["median_ms"])


def test_configs_entries_and_reference_limit_options(tmp_path):
    code = main(
        [*QUICK_ARGS, "--output", str(tmp_path), "--configs", "24,32,64,4,2; 9,16,32,4,3",
         "--entries", "per_expert_loop,reference", "--reference-max-tokens", "10",
         "--activation", "swiglu", "--dtype", "float32"]
    )
    assert code == 0
    results = json.loads((tmp_path / "single-gpu.json").read_text())
    assert [c["shape"]["T"] for c in results["configs"]] == [24, 9]
    first, second = results["configs"]
    assert [e["name"] for e in first["entries"]] == ["per_expert_loop", "reference"]
    assert first["entries"][1]["status"] == "skipped"
    assert "--reference-max-tokens 10" in first["entries"][1]["reason"]
    assert second["entries"][1]["status"] == "ok"  # T=9 <= 10
    assert first["flops"] == metrics.moe_flops(24, 32, 64, 4, 2, "swiglu")
    assert first["entries"][0]["max_relative_error"] < 1e-5  # float32 end to end on the CPU


@pytest.mark.parametrize(
    "arguments",
    [["--entries", "bogus"], ["--suite", "no-such-suite"], ["--configs", "1,2,3"], ["--repeats", "0"],
     ["--configs", "8,16,16,4,5"], ["--configs", "8,16,16,4,2,tanh"], ["--configs", "no-such-set"]],
)
def test_bad_options_exit_with_code_2(tmp_path, arguments, capsys):
    assert main([*QUICK_ARGS, "--output", str(tmp_path), *arguments]) == 2
    assert "flashdmoe bench:" in capsys.readouterr().err
    assert not (tmp_path / "single-gpu.json").exists()


def test_parse_configs():
    assert parse_configs("8192,2048,2048,32,2;128,4096,1408,64,6") == [
        BenchConfig(BenchShape(8192, 2048, 2048, 32, 2)), BenchConfig(BenchShape(128, 4096, 1408, 64, 6))
    ]
    assert parse_configs(" 1,2048,768,128,8, swiglu ; 8,16,16,4,2") == [
        BenchConfig(BenchShape(1, 2048, 768, 128, 8), "swiglu"), BenchConfig(BenchShape(8, 16, 16, 4, 2))
    ]
    with pytest.raises(ValueError, match="expected 5 comma-separated integers"):
        parse_configs("8,16,a,4,2")
    with pytest.raises(ValueError, match="top_k=5"):
        parse_configs("8,16,16,4,5")
    with pytest.raises(ValueError, match="tokens=0"):
        parse_configs("0,16,16,4,1")


@pytest.mark.parametrize(
    ("text", "message"),
    [("8,16,16,4,2,tanh", r"--configs entry '8,16,16,4,2,tanh': activation 'tanh': expected one of"),
     ("8,16,16,4,2,", r"activation '': expected one of"),
     ("8,16,16,4,2,gelu,1", r"--configs entry '8,16,16,4,2,gelu,1': expected T,H,I,E,k or T,H,I,E,k,activation"),
     ("gelu,8,16,16,4,2", r"--configs entry 'gelu,8,16,16,4,2': expected 5 comma-separated integers"),
     (" ; ", r"--configs ' ; ': expected at least one")],
)
def test_parse_configs_rejects_bad_entries_naming_the_argument(text, message):
    with pytest.raises(ValueError, match=message):
        parse_configs(text)


def _bench_options(*arguments):
    parser = bench_cli.configure_parser(argparse.ArgumentParser())
    return bench_cli.options_from_args(parser.parse_args(["--device", "cpu", *arguments]),
                                       Console(record=True, width=200))


def test_named_config_sets_are_the_targets_table():
    options = _bench_options("--configs", "targets")
    rows = [(*shape.to_dict().values(), options.activation_of(index)) for index, shape in enumerate(options.shapes)]
    assert rows == [
        (8192, 2048, 2048, 32, 2, "gelu"), (16384, 2048, 2048, 64, 2, "gelu"), (16384, 4096, 1024, 128, 2, "gelu"),
        (4096, 2048, 2048, 64, 2, "gelu"), (128, 4096, 1408, 64, 6, "gelu"),
        (4096, 4096, 14336, 8, 2, "swiglu"), (8192, 2048, 768, 128, 8, "swiglu"),
        (16384, 2048, 1408, 64, 6, "swiglu"), (8192, 7168, 2048, 256, 8, "swiglu"),
        (4096, 2048, 1024, 64, 8, "swiglu"), (1, 2048, 768, 128, 8, "swiglu"), (32, 7168, 2048, 256, 8, "swiglu"),
        (128, 4096, 1408, 64, 6, "swiglu"),
    ]
    named = single_gpu.SUITE.named_configs
    assert named["targets"] == named["targets-gelu"] + named["targets-swiglu"]
    # a set's own activations win over --activation
    swiglu = _bench_options("--configs", "targets-swiglu", "--activation", "relu")
    assert {swiglu.activation_of(index) for index in range(len(swiglu.shapes))} == {"swiglu"}


def test_per_config_activation_options():
    options = _bench_options("--configs", "24,32,64,4,2,swiglu;9,16,32,4,3", "--activation", "relu")
    assert [options.activation_of(0), options.activation_of(1)] == ["swiglu", "relu"]
    plain = _bench_options("--configs", "24,32,64,4,2")
    assert plain.shape_activations == () and plain.activation_of(0) == "gelu"  # the suite's default
    with pytest.raises(ValueError, match=r"--configs 'nonsense': expected 'T,H,I,E,k\[,activation\];...' or a named "
                                         r"set of the single-gpu suite \(\['targets'"):
        _bench_options("--configs", "nonsense")
    with pytest.raises(ValueError, match="--configs: the expert-parallel suite takes no activation per entry"):
        _bench_options("--suite", "expert-parallel", "--configs", "24,32,64,4,2,swiglu")
    with pytest.raises(ValueError, match="shape_activations has 1 entries: expected one per shape"):
        SuiteOptions(suite="single-gpu", device="cpu", dtype="float32", activation="gelu",
                     shapes=[BenchShape(8, 8, 8, 2, 1)] * 2, entries=["reference"], shape_activations=("gelu",))


def test_a_run_mixing_activations_has_an_act_column(tmp_path):
    code = main([*QUICK_ARGS, "--output", str(tmp_path), "--configs", "24,32,64,4,2,swiglu;9,16,32,4,3",
                 "--activation", "silu", "--entries", "per_expert_loop,reference", "--dtype", "float32"])
    assert code == 0
    results = json.loads((tmp_path / "single-gpu.json").read_text())
    assert [(c["shape"]["act"], c["activation"]) for c in results["configs"]] == [("swiglu", "swiglu"),
                                                                                  ("silu", "silu")]
    assert [c["flops"] for c in results["configs"]] == [metrics.moe_flops(24, 32, 64, 4, 2, "swiglu"),
                                                         metrics.moe_flops(9, 16, 32, 4, 3, "silu")]
    assert results["settings"]["activation"] == "per configuration (column act)"
    for config in results["configs"]:
        assert [e["correct"] for e in config["entries"]] == [True, True]  # each against its own activation
    assert "| T | H | I | E | k | act | floor ms |" in (tmp_path / "single-gpu.md").read_text()


def test_input_sets_that_fit_hold_at_most_two_deepseek_v3_layers(monkeypatch):
    deepseek_v3 = BenchShape(8192, 7168, 2048, 256, 8)
    weights = 256 * (7168 * 4096 + 2048 * 7168) * 2
    assert weights == pytest.approx(22.5e9, rel=0.01)
    assert workload.input_set_bytes(deepseek_v3, "swiglu", 2) == weights + 2 * (8192 * 7168 + 256 * 7168)
    assert single_gpu._input_sets_that_fit(deepseek_v3, "swiglu", torch.bfloat16, torch.device("cpu")) is None
    for free, fit in ((140e9, 2), (100e9, 1), (20e9, 1)):  # an H200's ~140 GB free; never below one set
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), int(141e9)))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
        assert single_gpu._input_sets_that_fit(deepseek_v3, "swiglu", torch.bfloat16, torch.device("cuda")) == fit
    with pytest.raises(ValueError, match="per_set_bytes=0"):
        workload.sets_that_fit(0, 0, 10)


def test_floor_counts_the_experts_routed_to_and_records_the_expectation(quick_run):
    _, _, results = quick_run
    for config, shape in zip(results["configs"], single_gpu.QUICK_SHAPES):
        active = config["details"]["active_experts_per_set"]
        assert len(active) == config["input_sets"] and all(1 <= count <= shape.experts for count in active)
        mean_floor = sum(metrics.bytes_floor(count, shape.tokens, shape.hidden, shape.ffn, "gelu", 2)
                         for count in active) / len(active)
        assert config["bytes_floor"] == round(mean_floor)
        assert config["details"]["expected_active_experts"] == pytest.approx(
            shape.experts * (1 - (1 - shape.top_k / shape.experts) ** shape.tokens))
    assert metrics.expected_active_experts(1, 128, 8) == pytest.approx(8.0)
    assert metrics.expected_active_experts(8192, 256, 8) == pytest.approx(256.0)


# ------------------------------------------------------------------------------------------------
# Baselines against the reference


def _random_problem(seed, tokens, hidden, ffn, experts, activation, dtype=torch.float32):
    shape = BenchShape(tokens, hidden, ffn, experts, 1)
    return make_inputs(shape, activation=activation, dtype=dtype, device="cpu", seed=seed)


# Float32 forwards that differ from the reference only in summation order: every problem in this file has
# H, I and T at most 512; three reductions in a row (router, GEMM1, GEMM2).
FLOAT32_FORWARD_TOLERANCE = numerics.reorder_tolerance(torch.float32, 512, depth=3)

BASELINE_CASES = [
    # (tokens, hidden, ffn, experts, top_k, activation, normalize_topk)
    (37, 24, 40, 8, 2, "gelu", True),
    (50, 16, 32, 6, 3, "relu", False),
    (19, 32, 24, 4, 1, "silu", True),
    (33, 16, 16, 8, 2, "swiglu", True),
    (5, 16, 32, 16, 1, "gelu", True),  # most experts get no token: empty groups
    (12, 8, 16, 4, 4, "swiglu", False),  # k = E
]


def _baseline_functions():
    functions = [baselines.per_expert_loop]
    if baselines.grouped_mm_available():
        functions.append(baselines.grouped_mm_pipeline)
    return functions


@pytest.mark.parametrize("baseline", _baseline_functions(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BASELINE_CASES, ids=lambda c: f"T{c[0]}-E{c[3]}-k{c[4]}-{c[5]}")
def test_baseline_equals_reference_float32(baseline, case):
    tokens, hidden, ffn, experts, top_k, activation, normalize = case
    inputs = _random_problem(BASELINE_CASES.index(case), tokens, hidden, ffn, experts, activation)
    got = baseline(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                   top_k=top_k, activation=activation, normalize_topk=normalize)
    want = reference.moe(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                         top_k=top_k, activation=activation, normalize_topk=normalize)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    # float32 on both sides, same routing (same fp32 router GEMM); only summation order differs
    assert_normwise_close(got, want, FLOAT32_FORWARD_TOLERANCE)


@pytest.mark.parametrize("baseline", _baseline_functions(), ids=lambda f: f.__name__)
def test_baseline_equals_reference_bfloat16(baseline):
    inputs = _random_problem(7, 64, 64, 96, 8, "gelu", dtype=torch.bfloat16)
    got = baseline(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                   top_k=2, activation="gelu", normalize_topk=True)
    want = reference.moe(inputs.x, inputs.router_weight, inputs.w1, inputs.w2, top_k=2, activation="gelu")
    assert got.dtype == torch.bfloat16
    routing = reference.route(inputs.x, inputs.router_weight, 2)
    keep = ~metrics.near_tie_mask(routing.probs, 2)
    # bf16 operands and a bf16 intermediate in the baseline, fp32 in the reference
    assert metrics.max_relative_error(got, want, keep).max_relative_error < metrics.ERROR_TOLERANCES["bfloat16"]


@pytest.mark.skipif(not baselines.grouped_mm_available(), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("layout", sorted(baselines.GROUPED_MM_LAYOUTS))
def test_grouped_mm_weight_layouts_give_the_same_output(layout):
    inputs = _random_problem(11, 29, 32, 48, 8, "swiglu")
    w1, w2, chosen, trials = baselines.prepare_grouped_mm_weights(
        inputs.x, inputs.router_weight, inputs.w1, inputs.w2, top_k=2, activation="swiglu",
        layouts=(layout,),
    )
    assert chosen == layout and set(trials) == {layout}
    assert torch.equal(w1, inputs.w1) and torch.equal(w2, inputs.w2)
    if layout == "column-major":
        assert w1.stride(-2) == 1 and w2.stride(-2) == 1
    got = baselines.grouped_mm_pipeline(inputs.x, inputs.router_weight, w1, w2, top_k=2, activation="swiglu")
    want = reference.moe(inputs.x, inputs.router_weight, inputs.w1, inputs.w2, top_k=2, activation="swiglu")
    assert_normwise_close(got, want, FLOAT32_FORWARD_TOLERANCE)


def test_baselines_reject_bad_arguments():
    inputs = _random_problem(3, 8, 16, 32, 4, "gelu")
    with pytest.raises(ValueError, match="activation='tanh'"):
        baselines.per_expert_loop(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                                  top_k=1, activation="tanh")
    with pytest.raises(ValueError, match="top_k=5"):
        baselines.per_expert_loop(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                                  top_k=5, activation="gelu")
    with pytest.raises(ValueError, match="w1.shape"):
        baselines.per_expert_loop(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                                  top_k=1, activation="swiglu")


# ------------------------------------------------------------------------------------------------
# Suite internals: a wrong or failing entry is caught, not hidden


class _WrongEntry(BenchEntry):
    name = "wrong"
    label = "wrong answer"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        return PreparedRun(lambda: inputs.x * 1.5)


class _CrashingEntry(BenchEntry):
    name = "crashing"
    label = "crashes"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        def forward():
            raise RuntimeError("device fell over")

        return PreparedRun(forward)


def test_wrong_and_failing_entries_are_reported(monkeypatch):
    monkeypatch.setitem(ENTRY_TYPES, "wrong", _WrongEntry)
    monkeypatch.setitem(ENTRY_TYPES, "crashing", _CrashingEntry)
    options = SuiteOptions(
        suite="single-gpu", device="cpu", dtype="float32", activation="gelu",
        shapes=[BenchShape(16, 16, 32, 4, 2)], entries=["per_expert_loop", "wrong", "crashing"],
        repeats=2, warmup=0,
    )
    result = single_gpu.run_single_gpu(options)
    loop, wrong, crashing = result.configs[0].entries
    assert loop.status == "ok" and loop.correct is True
    assert wrong.status == "ok" and wrong.correct is False and wrong.max_relative_error > 0.1
    assert crashing.status == "error" and crashing.reason == "RuntimeError: device fell over"


class _ProfiledLoopEntry(BenchEntry):
    """The per-expert loop, declaring a kernel of its own as the fused entries do."""

    name = "profiled_loop"
    label = "loop with a kernel"
    profiled_kernel = "moe_forward_kernel"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        return PreparedRun(lambda: baselines.per_expert_loop(inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                                                             **problem.kwargs()))


def test_kernel_time_is_null_on_the_cpu_and_profiled_after_the_timed_runs(monkeypatch):
    monkeypatch.setitem(ENTRY_TYPES, "profiled_loop", _ProfiledLoopEntry)
    options = SuiteOptions(
        suite="single-gpu", device="cpu", dtype="float32", activation="gelu",
        shapes=[BenchShape(16, 16, 32, 4, 2)], entries=["profiled_loop", "per_expert_loop"], repeats=2, warmup=0,
    )
    result = single_gpu.run_single_gpu(options)
    profiled, loop = result.configs[0].entries
    assert profiled.status == loop.status == "ok" and profiled.correct is True
    assert profiled.kernel_ms is None and loop.kernel_ms is None
    assert profiled.details["kernel_profile"] == {"kernel": "moe_forward_kernel", "launches": 0,
                                                  "reason": "no CUDA kernels on cpu"}
    assert "kernel_profile" not in loop.details  # no kernel of its own: not profiled at all
    assert json.loads(report.json_text(result))["configs"][0]["entries"][0]["kernel_ms"] is None
    markdown = report.markdown_report(result)
    assert "| ms (median) | p10–p90 ms | kernel ms (profiler) | TFLOP/s |" in markdown
    cells = [line.split(" | ") for line in markdown.splitlines() if "| loop with a kernel |" in line][0]
    assert cells[cells.index("loop with a kernel") + 3] == "–"

    # The profile is a pass of its own after the timed runs, over the same prepared runs.
    order = []
    real_measure = timing.measure_phases
    monkeypatch.setattr(timing, "measure_phases", lambda runs, **kw: order.append(("measure", len(runs)))
                        or real_measure(runs, **kw))
    monkeypatch.setattr(kernel_profile, "profile_kernel", lambda runs, **kw: order.append(("profile", len(runs)))
                        or kernel_profile.KernelTime(0.25, 6))
    options.entries = ["profiled_loop"]
    options.input_sets = 3
    timed = single_gpu.run_single_gpu(options).configs[0].entries[0]
    # After the copy bandwidth's measurement: repeats=2 as two rounds of one run, then the profile.
    assert order[1:] == [("measure", 3), ("measure", 3), ("profile", 3)]
    assert timed.kernel_ms == 0.25 and timed.details["kernel_profile"]["launches"] == 6


class _CountingEntry(BenchEntry):
    """The per-expert loop, logging each call under its name (set per test) into ``calls``."""

    calls: list[str] = []
    fail_after: int | None = None

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        def forward():
            if self.fail_after is not None and self.calls.count(self.name) >= self.fail_after:
                raise RuntimeError("lost the device")
            self.calls.append(self.name)
            return baselines.per_expert_loop(inputs.x, inputs.router_weight, inputs.w1, inputs.w2, **problem.kwargs())

        return PreparedRun(forward)


def test_entries_are_timed_in_turns_so_clock_drift_falls_on_all_of_them(monkeypatch):
    calls: list[str] = []
    first = type("_First", (_CountingEntry,), {"name": "first", "label": "first", "calls": calls})
    second = type("_Second", (_CountingEntry,), {"name": "second", "label": "second", "calls": calls,
                                                 "fail_after": 8})
    monkeypatch.setitem(ENTRY_TYPES, "first", first)
    monkeypatch.setitem(ENTRY_TYPES, "second", second)
    assert timing.round_sizes(10) == [3, 3, 2, 2] and timing.round_sizes(2) == [1, 1]
    options = SuiteOptions(
        suite="single-gpu", device="cpu", dtype="float32", activation="gelu",
        shapes=[BenchShape(16, 16, 32, 4, 2)], entries=["first", "second"], repeats=8, warmup=2,
    )
    one, two = single_gpu.run_single_gpu(options).configs[0].entries
    # Each entry's correctness call, then the rounds: 2 warm-up runs and 2 timed ones first, then 1 + 2;
    # the second round in reverse order.
    runs = [name for name in calls]
    assert runs[:2] == ["first", "second"]
    rounds = [runs[2:6], runs[6:10], runs[10:13], runs[13:16], runs[16:19]]
    assert rounds == [["first"] * 4, ["second"] * 4, ["second"] * 3, ["first"] * 3, ["first"] * 3]
    # The second entry fails in its third round (its 9th call): an error row, the first goes on alone.
    assert runs[19:] == ["first"] * 3
    assert one.status == "ok" and len(one.samples_ms) == 8 and one.correct is True
    assert two.status == "error" and two.reason == "RuntimeError: lost the device"
    assert "sm_clock_mhz" not in one.details and single_gpu.hardware.sm_clock_mhz("cpu") is None  # no GPU clock
    assert report.clock_text(one) == "–"
    clocked = EntryResult("fused", "fused", "ok", details={"sm_clock_mhz": [1980, 1455, 1710]})
    assert report.clock_text(clocked) == "1455–1980"
    assert report.clock_text(EntryResult("fused", "fused", "ok", details={"sm_clock_mhz": [1980, 1980]})) == "1980"


def test_turns_refuse_zero_repeats_instead_of_running_no_round():
    with pytest.raises(ValueError, match="repeats=0"):
        timing.measure_in_turns([[(lambda: None,)]], device="cpu", repeats=0)


def test_kernel_time_from_profiler_events():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, microseconds, device_type=cuda):
        return argparse.Namespace(name=name, device_time=microseconds, device_type=device_type)

    events = [event("void moe_forward_kernel<bf16, V>(LaunchParams)", 640.0), event("Memset (Device)", 2.0),
              event("void moe_forward_kernel<bf16, V>(LaunchParams)", 600.0),
              event("void moe_forward_kernel<bf16, V>(LaunchParams)", 700.0),
              event("moe_forward_kernel host op", 5000.0, cpu)]  # a host event summing its kernels: not counted
    assert kernel_profile.kernel_time_from_events(events, "moe_forward_kernel") == kernel_profile.KernelTime(0.64, 3)
    renamed = kernel_profile.kernel_time_from_events(events[1:2], "moe_forward_kernel")
    assert renamed == kernel_profile.KernelTime(None, 0, "no 'moe_forward_kernel' kernel in the profile")
    calls = []
    on_cpu = kernel_profile.profile_kernel([lambda: calls.append(1)], device="cpu", kernel_name="moe_forward_kernel")
    assert on_cpu.milliseconds is None and calls == []  # nothing runs off CUDA
    with pytest.raises(ValueError, match="runs=\\[\\]"):
        kernel_profile.profile_kernel([], device="cpu", kernel_name="k")
    with pytest.raises(ValueError, match="calls=0"):
        kernel_profile.profile_kernel([lambda: None], device="cpu", kernel_name="k", calls=0)


def test_profiled_calls_taken_apart_into_kernel_other_activities_and_idle_time():
    cuda = torch.autograd.DeviceType.CUDA

    def event(name, start, end):
        return argparse.Namespace(name=name, device_time=end - start, device_type=cuda,
                                  time_range=argparse.Namespace(start=start, end=end))

    # Two calls (µs): a memset then the kernel each, one gap of 100 between the calls, and a copy that
    # overlaps the second kernel (counted as activity, not twice as busy time).
    events = [event("Memset (Device)", 0.0, 10.0), event("void moe_forward_kernel<V>()", 10.0, 510.0),
              event("Memset (Device)", 610.0, 620.0), event("void moe_forward_kernel<V>()", 620.0, 1120.0),
              event("Memcpy DtoD (Device -> Device)", 700.0, 740.0)]
    profile = kernel_profile.kernel_time_from_events(events, "moe_forward_kernel", calls=2)
    assert profile.milliseconds == pytest.approx(0.5) and profile.launches == 2
    assert profile.span_ms == pytest.approx(1120.0 / 2 / 1e3)
    assert profile.other_ms == pytest.approx((10 + 10 + 40) / 2 / 1e3)
    assert profile.idle_ms == pytest.approx(100.0 / 2 / 1e3)  # only the gap between the calls
    assert profile.others == {"Memcpy DtoD (Device -> Device)": pytest.approx(0.02),
                              "Memset (Device)": pytest.approx(0.01)}
    details = profile.details()
    assert details["span_ms"] == profile.span_ms and details["others"] == profile.others
    assert "milliseconds" not in details  # the entry's kernel_ms carries it
    # Without the call count only the kernel's median, as before.
    assert kernel_profile.kernel_time_from_events(events, "moe_forward_kernel").span_ms is None


# ------------------------------------------------------------------------------------------------
# Metrics and timing


def test_near_tie_mask_and_relative_error():
    probabilities = torch.tensor([[0.4, 0.3, 0.3], [0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    assert metrics.near_tie_mask(probabilities, 1).tolist() == [False, False, False]
    assert metrics.near_tie_mask(probabilities, 2).tolist() == [True, False, False]
    assert metrics.near_tie_mask(probabilities, 3).tolist() == [False, False, False]  # k = E
    expected = torch.tensor([[1.0, -2.0], [4.0, 0.5]])
    output = torch.tensor([[1.1, -2.0], [4.0, 0.0]])
    report = metrics.max_relative_error(output, expected, torch.tensor([True, True]))
    assert report.max_relative_error == pytest.approx(0.5 / 4.0) and report.compared_tokens == 2
    report = metrics.max_relative_error(output, expected, torch.tensor([True, False]))
    assert report.max_relative_error == pytest.approx(0.1 / 2.0) and report.compared_tokens == 1
    output[0, 0] = float("nan")
    assert metrics.max_relative_error(output, expected, torch.tensor([True, True])).max_relative_error == float("inf")


def test_timing_statistics_of_known_samples():
    samples = [float(value) for value in range(10, 0, -1)]
    stats = timing.TimingStats.from_samples(samples)
    assert stats.median_ms == 5.5
    assert stats.p10_ms == pytest.approx(np.percentile(samples, 10))
    assert stats.p90_ms == pytest.approx(np.percentile(samples, 90))
    assert stats.samples_ms == tuple(samples)  # run order kept
    with pytest.raises(ValueError, match="samples_ms"):
        timing.TimingStats.from_samples([])


def test_measure_times_a_sleep_and_rotates_inputs():
    calls = []

    def sleeper(tag, seconds):
        def run():
            calls.append(tag)
            time.sleep(seconds)
        return run

    stats = timing.measure([sleeper("a", 0.004), sleeper("b", 0.012)], device="cpu", warmup=2, repeats=20)
    assert calls == ["a", "b"] * 11  # 2 warm-up + 20 timed, round robin
    assert len(stats.samples_ms) == 20
    # timed runs alternate a (4 ms) and b (12 ms): every sample at least its sleep, p10 near 4, p90 near 12
    assert all(sample >= 4.0 for sample in stats.samples_ms[0::2])
    assert all(sample >= 12.0 for sample in stats.samples_ms[1::2])
    assert 4.0 <= stats.p10_ms < 12.0 <= stats.p90_ms
    assert stats.p10_ms <= stats.median_ms <= stats.p90_ms
    with pytest.raises(ValueError, match="repeats=0"):
        timing.measure([sleeper("a", 0)], device="cpu", repeats=0)


def test_input_sets_exceed_twice_the_cache():
    megabyte = 1 << 20
    assert timing.input_sets_for_cache(10 * megabyte, 60 * megabyte, limit=32) == 12
    assert timing.input_sets_for_cache(10 * megabyte, 60 * megabyte, limit=8) == 8
    assert timing.input_sets_for_cache(500 * megabyte, 60 * megabyte, limit=32) == 1


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_quick_run_on_gpu(tmp_path):
    code = main(["--device", "cuda", "--quick", "--repeats", "5", "--warmup", "2", "--output", str(tmp_path)])
    results = json.loads((tmp_path / "single-gpu.json").read_text())
    assert code == 0
    assert results["machine"]["gpu_name"] and results["ceiling_tflops"] > 10
    for config in results["configs"]:
        for entry in config["entries"]:
            assert entry["status"] in ("ok", "unavailable"), entry
            assert entry["status"] == "ok" or entry["reason"]
        by_name = {entry["name"]: entry for entry in config["entries"]}
        assert by_name["grouped_mm"]["status"] == "ok", by_name["grouped_mm"]["reason"]
        for entry in config["entries"]:
            assert entry["status"] != "ok" or entry["correct"] is True, entry
        if config["shape"]["H"] % 64 == 0:  # the kernel's shape rule
            assert by_name["fused"]["status"] == by_name["fused_graph"]["status"] == "ok", by_name
            for name in ("fused", "fused_graph"):  # the kernel alone, eager and inside graph replays
                fused = by_name[name]
                assert fused["details"]["kernel_profile"]["launches"] == kernel_profile.PROFILED_CALLS, fused
                assert 0 < fused["kernel_ms"] <= 1.5 * fused["median_ms"], fused
        for name in ("grouped_mm", "per_expert_loop", "reference"):
            assert by_name[name]["kernel_ms"] is None


# ------------------------------------------------------------------------------------------------------------
# expert-parallel suite (CPU: registration, options, aggregation and tables; the GPU run is below)

EP_ARGS = ["--suite", "expert-parallel", "--device", "cpu", "--quick", "--repeats", "2", "--warmup", "0"]
EP_ENTRIES = ["single", "emulated-1", "emulated-2", "emulated-4", "emulated-8", "mps-2", "mps-2-nvshmem", "mps-4",
              "mps-4-nvshmem", "mps-4-2nodes", "mps-4-2nodes-hierarchical", "reference"]


def test_suites_are_listed_in_one_registry():
    assert list(registry.SUITES) == ["single-gpu", "expert-parallel", "multi-gpu", "training"]
    assert [registry.get_suite(name).name for name in registry.SUITES] == list(registry.SUITES)
    with pytest.raises(ValueError, match=r"--suite 'nope': expected one of \['expert-parallel'"):
        registry.get_suite("nope")
    help_text = " ".join(bench_cli.configure_parser(argparse.ArgumentParser()).format_help().split())
    assert "single-gpu, expert-parallel, multi-gpu, training" in help_text


def test_expert_parallel_suite_is_registered():
    suite = registry.get_suite("expert-parallel")
    assert list(suite.entry_names) == EP_ENTRIES
    assert suite.validate is expert_parallel.validate_options
    assert BenchShape(8192, 2048, 2048, 32, 2) in suite.default_shapes  # the paper's problem, as the total
    assert all(shape.experts % 8 == 0 for shape in suite.default_shapes + suite.quick_shapes)
    assert suite.layout is expert_parallel.EP_LAYOUT
    assert registry.get_suite("single-gpu").layout is report.DEFAULT_LAYOUT
    help_text = bench_cli.configure_parser(argparse.ArgumentParser()).format_help()
    assert "expert-parallel" in help_text and "single-gpu" in help_text


@pytest.fixture(scope="module")
def ep_quick_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("bench-ep")
    code = main([*EP_ARGS, "--output", str(output)])
    return code, output, json.loads((output / "expert-parallel.json").read_text())


def test_expert_parallel_quick_run_on_cpu(ep_quick_run):
    code, output, results = ep_quick_run
    assert code == 0
    assert results["suite"] == "expert-parallel" and results["ceiling_tflops"] is None
    assert (output / "expert-parallel.png").read_bytes()[:8] == PNG_MAGIC
    assert [c["shape"] for c in results["configs"]] == [s.to_dict() for s in expert_parallel.EP_QUICK_SHAPES]
    for config in results["configs"]:
        entries = {entry["name"]: entry for entry in config["entries"]}
        assert list(entries) == EP_ENTRIES
        for name in EP_ENTRIES[:-1]:  # everything but the reference needs the GPU
            assert entries[name]["status"] == "unavailable" and "CUDA" in entries[name]["reason"], entries[name]
        assert [entries[n]["details"]["world_size"] for n in EP_ENTRIES] == [1, 1, 2, 4, 8, 2, 2, 4, 4, 4, 4, 1]
        assert [entries[n]["details"].get("peer_transport") for n in EP_ENTRIES if n.startswith("mps")] == [
            "p2p", "nvshmem", "p2p", "nvshmem", "auto", "auto"]
        assert entries["mps-4-2nodes"]["details"]["ranks_per_node"] == 2
        assert "exchange" not in entries["mps-4-2nodes"]["details"]
        assert entries["mps-4-2nodes-hierarchical"]["details"]["exchange"] == "hierarchical"
        ref = entries["reference"]
        assert ref["status"] == "ok" and ref["max_relative_error"] == 0.0 and ref["correct"] is True
        assert len(ref["samples_ms"]) == 2 and ref["tflops"] > 0
        T = config["shape"]["T"]
        assert config["details"]["tokens_per_rank"]["emulated-8"] == [T // 8] * 8
    markdown = (output / "expert-parallel.md").read_text()
    assert ("| T | H | I | E | k | P | entry | ms (median) | p10–p90 ms | TFLOP/s | % of ceiling | vs P=1 | "
            "sent MB / rank (max) | of it NVSHMEM MB | payload eff. | max rel. error | status |") in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(results["configs"]) * len(EP_ENTRIES)
    assert "- T is the total over the ranks" in markdown and "floor =" not in markdown


@pytest.mark.parametrize("arguments, message", [
    (["--entries", "emulated-3"], "--entries 'emulated-3'"),
    (["--entries", "mps-8"], "--entries 'mps-8'"),
    (["--entries", "mps-2-p2p"], "--entries 'mps-2-p2p'"),
    (["--entries", "emulated-2-nvshmem"], "--entries 'emulated-2-nvshmem'"),
    (["--configs", "64,64,128,6,2"], "E=6 is not divisible by P=4 (entry emulated-4)"),
    (["--configs", "64,64,128,12,2", "--entries", "emulated-8"], "E=12 is not divisible by P=8"),
])
def test_expert_parallel_bad_options_exit_with_code_2(tmp_path, capsys, arguments, message):
    assert main([*EP_ARGS, "--output", str(tmp_path), *arguments]) == 2
    assert message in " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert not (tmp_path / "expert-parallel.json").exists()


def test_expert_parallel_accepts_experts_divisible_by_the_chosen_ranks():
    parser = bench_cli.configure_parser(argparse.ArgumentParser())
    args = parser.parse_args([*EP_ARGS, "--configs", "64,64,128,6,2", "--entries", "emulated-2,mps-2,reference"])
    options = bench_cli.options_from_args(args, None)
    assert options.entries == ["emulated-2", "mps-2", "reference"] and options.shapes[0].experts == 6


def test_expert_parallel_problems_are_the_same_total_for_every_p():
    options = SuiteOptions(suite="expert-parallel", device="cpu", dtype="bfloat16", activation="swiglu",
                                  shapes=[], entries=[], seed=4)
    shape = BenchShape(10, 64, 64, 8, 2)
    one = expert_parallel.problem_for(shape, 1, options, 2, 1)
    four = expert_parallel.problem_for(shape, 4, options, 2, 1)
    assert four.tokens == (3, 3, 2, 2) and one.seed == four.seed == 4 + 2000 + 1
    assert four.activation == "swiglu" and four.capacity_factor is None
    inputs = four.all_inputs()
    assert torch.equal(torch.cat([i.x for i in inputs]), one.all_tokens())
    assert torch.equal(torch.cat([i.w1 for i in inputs]), one.shard(0)[0])
    assert torch.equal(torch.cat([i.w2 for i in inputs]), one.shard(0)[1])


def test_traffic_summary():
    traffic = [
        {"rank": 0, "dispatch_bytes": 4 * 64 * 2, "combine_bytes": 6 * 64 * 2, "rows_routed_remote": 4},
        {"rank": 1, "dispatch_bytes": 6 * 64 * 2, "combine_bytes": 4 * 64 * 2, "rows_routed_remote": 5},
    ]
    summary = rank_results.traffic_summary(traffic, 64, 2)
    assert summary["bytes_sent_per_rank"] == [1280, 1280] and summary["max_bytes_sent_per_rank"] == 1280
    assert summary["payload_efficiency"] == pytest.approx(10 / 9)  # rank 1 sent one row more than it routed
    alone = rank_results.traffic_summary([{"rank": 0, "dispatch_bytes": 0, "combine_bytes": 0,
                                               "rows_routed_remote": 0}], 64, 2)
    assert alone["max_bytes_sent_per_rank"] == 0 and alone["payload_efficiency"] is None
    assert rank_results.traffic_summary([], 64, 2)["max_bytes_sent_per_rank"] is None
    assert summary["nvshmem_bytes_sent_per_rank"] is None  # counters without NVSHMEM words (the unfused baseline)
    over_nvshmem = rank_results.traffic_summary(
        [t | {"nvshmem_dispatch_bytes": t["dispatch_bytes"], "nvshmem_combine_bytes": 64 * 2 * r}
         for r, t in enumerate(traffic)], 64, 2)
    assert over_nvshmem["nvshmem_bytes_sent_per_rank"] == [4 * 64 * 2, 6 * 64 * 2 + 64 * 2]
    assert over_nvshmem["max_nvshmem_bytes_sent_per_rank"] == 7 * 64 * 2
    assert over_nvshmem["bytes_sent_per_rank"] == summary["bytes_sent_per_rank"]


def _rank(rank, samples, y, traffic):
    return RankOutcome(rank, "ok", 0, info={"samples_ms": samples, "median_ms": float(np.median(samples)),
                                            "traffic": [traffic], "input_sets": 1}, tensors={"y": y})


def test_mps_entries_per_transport():
    plain, over_nvshmem = expert_parallel.entry_spec("mps-4"), expert_parallel.entry_spec("mps-4-nvshmem")
    assert (plain.kind, plain.world_size, plain.peer_transport) == ("mps", 4, "p2p")
    assert (over_nvshmem.kind, over_nvshmem.world_size, over_nvshmem.peer_transport) == ("mps", 4, "nvshmem")
    assert over_nvshmem.label == "4 processes (MPS), nvshmem"
    assert expert_parallel.entry_spec("emulated-2").peer_transport is None
    for name in ("mps-4-p2p", "mps-8-nvshmem", "mps-4-nvshmem-x", "emulated-2-nvshmem"):
        with pytest.raises(ValueError, match=f"entry {name!r}"):
            expert_parallel.entry_spec(name)
    problem = Problem((5, 3), 64, 64, 8, 2, "gelu", seed=next_seed())
    sizes = problem.team_kwargs()
    assert expert_parallel.mps_run_kwargs(expert_parallel.entry_spec("mps-2"), problem) == {
        "team": sizes | {"peer_transport": "p2p"}}
    assert expert_parallel.mps_run_kwargs(expert_parallel.entry_spec("mps-2-nvshmem"), problem) == {
        "team": sizes | {"peer_transport": "nvshmem"}, "env": {"FLASHDMOE_KERNEL_BUILD": "nvshmem"}}
    nodes = expert_parallel.entry_spec("mps-4-2nodes")
    assert (nodes.world_size, nodes.peer_transport, nodes.ranks_per_node) == (4, "auto", 2)
    assert expert_parallel.mps_run_kwargs(nodes, problem) == {
        "team": sizes | {"peer_transport": "auto", "ranks_per_node": 2}, "env": {"FLASHDMOE_KERNEL_BUILD": "nvshmem"}}
    relayed = expert_parallel.entry_spec("mps-4-2nodes-hierarchical")
    assert expert_parallel.mps_run_kwargs(relayed, problem) == {
        "team": sizes | {"peer_transport": "auto", "ranks_per_node": 2, "exchange": "hierarchical"},
        "env": {"FLASHDMOE_KERNEL_BUILD": "nvshmem"}}
    with pytest.raises(ValueError, match="entry 'mps-2-2nodes'"):
        expert_parallel.entry_spec("mps-2-2nodes")


@pytest.mark.parametrize("nvshmem_reason", [None, "FLASHDMOE_NVSHMEM_HOME lacks include/nvshmem.h"])
def test_mps_runs_per_transport_with_stand_ins(monkeypatch, nvshmem_reason):
    """_run_mps_entries with the GPU, MPS and rank processes replaced: each entry's processes get its
    transport; without the NVSHMEM build only the nvshmem entries are unavailable (with the reason)."""
    from flashdmoe.kernel import extension

    runs, daemons, builds = [], [], []

    class StandInDaemon:
        def start(self):
            daemons.append("started")

        def stop(self):
            daemons.append("stopped")

    def run_ranks(scenario, world_size, **kwargs):
        runs.append((world_size, kwargs))
        return "run"

    monkeypatch.setattr(expert_parallel, "_kernel_unavailable_reason", lambda options: None)
    monkeypatch.setattr(expert_parallel, "nvshmem_unavailable_reason", lambda: None)
    monkeypatch.setattr(expert_parallel, "mps_available", lambda: None)
    monkeypatch.setattr(expert_parallel, "MpsDaemon", StandInDaemon)
    monkeypatch.setattr(expert_parallel, "run_ranks", run_ranks)
    monkeypatch.setattr(extension, "nvshmem_problem", lambda: nvshmem_reason)
    monkeypatch.setattr(extension, "build_nvshmem", lambda: builds.append("nvshmem"))
    names = ["mps-2", "mps-2-nvshmem", "mps-4-nvshmem"]
    options = SuiteOptions(suite="expert-parallel", device="cuda", dtype="bfloat16", activation="gelu",
                           shapes=[BenchShape(12, 64, 64, 8, 2)], entries=names, seed=next_seed())
    out = expert_parallel._run_mps_entries(options, names)
    assert daemons == ["started", "stopped"]
    transports = [(size, kwargs["team"]["peer_transport"], kwargs.get("env")) for size, kwargs in runs]
    if nvshmem_reason is None:
        assert builds == ["nvshmem"]  # built once, before any rank process
        assert out == {(0, name): "run" for name in names}
        assert transports == [(2, "p2p", None), (2, "nvshmem", {"FLASHDMOE_KERNEL_BUILD": "nvshmem"}),
                              (4, "nvshmem", {"FLASHDMOE_KERNEL_BUILD": "nvshmem"})]
    else:
        assert builds == [] and transports == [(2, "p2p", None)] and out[(0, "mps-2")] == "run"
        for name in names[1:]:
            entry = out[(0, name)]
            assert entry.status == "unavailable" and entry.reason == nvshmem_reason, entry
            assert entry.details["peer_transport"] == "nvshmem"


def test_mps_rows_take_the_slowest_rank_per_forward_and_check_all_outputs():
    spec = expert_parallel.entry_spec("mps-2")
    y = torch.randn(10, 64)
    compare = torch.ones(10, dtype=torch.bool)
    traffic = {"dispatch_bytes": 128, "combine_bytes": 256, "rows_routed_remote": 1}
    run = RunResult("timed_fused_forwards", 2, [_rank(0, [1.0, 5.0, 2.0], y[:6], traffic | {"rank": 0}),
                                 _rank(1, [3.0, 1.0, 4.0], y[6:], traffic | {"rank": 1})], 9.0, True)
    entry = expert_parallel._mps_entry(spec, run, BenchShape(10, 64, 64, 8, 2), y, compare, "cpu", 2)
    assert entry.status == "ok" and entry.samples_ms == [3.0, 5.0, 4.0] and entry.median_ms == 4.0
    assert entry.max_relative_error == 0.0
    assert entry.details["rank_medians_ms"] == [2.0, 3.0] and entry.details["payload_efficiency"] == 1.0
    assert entry.details["max_bytes_sent_per_rank"] == 384
    wrong = RunResult("timed_fused_forwards", 2,
                      [run.ranks[0], _rank(1, [3.0, 1.0, 4.0], y[6:] + 1, traffic)], 9.0, True)
    assert expert_parallel._mps_entry(spec, wrong, BenchShape(10, 64, 64, 8, 2), y, compare, "cpu",
                                      2).max_relative_error > 0.1
    hung = RunResult("timed_fused_forwards", 2, [run.ranks[0], RankOutcome(1, "hung", -9, phase="timed forwards",
                                                            kill_reason="still running")], 600.0, True)
    failed = expert_parallel._mps_entry(spec, hung, BenchShape(10, 64, 64, 8, 2), y, compare, "cpu", 2)
    assert failed.status == "error" and "rank 1: hung in phase 'timed forwards'" in failed.reason


def test_expert_parallel_table_cells():
    details = rank_results.traffic_summary(
        [{"rank": r, "dispatch_bytes": 1_000_000, "combine_bytes": 2_150_000 + r, "rows_routed_remote": 1_000_000 // 128}
         for r in range(2)], 64, 2)
    nvshmem_details = rank_results.traffic_summary(
        [{"rank": r, "dispatch_bytes": 1_000_000, "combine_bytes": 2_150_000 + r, "rows_routed_remote": 1_000_000 // 128,
          "nvshmem_dispatch_bytes": 1_000_000, "nvshmem_combine_bytes": 2_150_000 + r} for r in range(2)], 64, 2)
    entries = [
        EntryResult("emulated-1", "emulated P=1", "ok", median_ms=1.2, p10_ms=1.1, p90_ms=1.3, tflops=100.0,
                    max_relative_error=5e-3, correct=True, details={"world_size": 1, "vs_p1": 1.0}),
        EntryResult("emulated-2", "emulated P=2", "ok", median_ms=1.5, p10_ms=1.4, p90_ms=1.6, tflops=80.0,
                    percent_of_ceiling=10.0, max_relative_error=6e-3, correct=True,
                    details={"world_size": 2, "vs_p1": 1.25} | details),
        EntryResult("mps-2", "2 processes (MPS)", "error", reason="rank 1: hung in phase 'x'",
                    details={"world_size": 2}),
        EntryResult("mps-2-nvshmem", "2 processes (MPS), nvshmem", "ok", median_ms=1.6, p10_ms=1.5, p90_ms=1.7,
                    tflops=75.0, max_relative_error=6e-3, correct=True,
                    details={"world_size": 2, "peer_transport": "nvshmem"} | nvshmem_details),
    ]
    config = ConfigResult("T=8 H=64 I=64 E=8 k=2", {"T": 8, "H": 64, "I": 64, "E": 8, "k": 2}, "gelu",
                          "bfloat16", 1, 1, entries)
    result = SuiteResult("expert-parallel", {"device": "cuda"}, {"notes": ["a note"]}, [config])
    markdown = report.markdown_report(result, layout=expert_parallel.EP_LAYOUT)
    assert "| 8 | 64 | 64 | 8 | 2 | 2 | emulated P=2 | 1.500 | 1.400–1.600 | 80.0 | 10.0 | 1.25x | 3.15 | – | 100.0% | " \
           "6.0e-03 | ok |" in markdown
    assert "| 8 | 64 | 64 | 8 | 2 | 1 | emulated P=1 | 1.200 | 1.100–1.300 | 100.0 | – | 1.00x | – | – | – |" in markdown
    assert "| 2 | 2 processes (MPS) | – | – | – | – | – | – | – | – | – | error: rank 1: hung in phase 'x' |" in markdown
    assert "| 2 | 2 processes (MPS), nvshmem | 1.600 | 1.500–1.700 | 75.0 | – | – | 3.15 | 3.15 | 100.0% |" in markdown
    assert "- a note" in markdown
    console = Console(record=True, width=200)
    console.print(report.rich_table(result, expert_parallel.EP_LAYOUT))
    text = console.export_text()
    assert "MB/rank" in text and "nvshmem MB" in text and "1.25x" in text and "100.0%" in text and "3.15" in text


def test_expert_parallel_in_process_entries_with_stand_ins(monkeypatch):
    """The suite's own code for the single / emulated / reference rows, with the kernel replaced by the
    reference and Team.emulated by a stand-in (the GPU test below runs the real ones)."""
    import flashdmoe
    from flashdmoe.parallel.team import Team

    monkeypatch.setattr(expert_parallel, "_kernel_unavailable_reason", lambda options: None)
    made, closed, traffic = [], [], []
    # (the traffic of a launch report needs a GPU: patch the reader)
    monkeypatch.setattr(expert_parallel, "_last_traffic", lambda: [dict(t) for t in traffic])

    class StandInTeam:
        buffer_bytes = 4096

        def __init__(self, world_size, **sizes):
            self.world_size, self.sizes = world_size, sizes
            made.append(self)

        def close(self):
            closed.append(self.world_size)

    def moe_expert_parallel(xs, router_weight, w1s, w2s, *, team, **kwargs):
        assert len(xs) == len(w1s) == len(w2s) == team.world_size
        traffic[:] = [  # every rank routes 3 rows elsewhere and sends exactly those
            {"rank": r, "dispatch_bytes": 3 * 64 * 4, "combine_bytes": 2 * 64 * 4, "rows_routed_remote": 3}
            for r in range(team.world_size)]
        return reference.moe_expert_parallel(xs, router_weight, w1s, w2s, **kwargs)

    monkeypatch.setattr(Team, "emulated", classmethod(lambda cls, world_size, **sizes: StandInTeam(world_size, **sizes)))
    monkeypatch.setattr(flashdmoe, "moe_expert_parallel", moe_expert_parallel, raising=False)
    monkeypatch.setattr(flashdmoe, "moe", lambda x, r, w1, w2, backend, **kw: reference.moe(x, r, w1, w2, **kw))
    options = SuiteOptions(
        suite="expert-parallel", device="cpu", dtype="float32", activation="silu",
        shapes=[BenchShape(30, 64, 64, 8, 2)], entries=["single", "emulated-1", "emulated-2", "emulated-8", "reference"],
        repeats=2, warmup=1, input_sets=2,
    )
    result = expert_parallel.run_expert_parallel(options)
    config = result.configs[0]
    entries = {entry.name: entry for entry in config.entries}
    assert config.input_sets == 2 and config.details["tokens_per_rank"]["emulated-8"] == (4, 4, 4, 4, 4, 4, 3, 3)
    for entry in entries.values():
        assert entry.status == "ok", entry.reason
        assert entry.correct is True and entry.max_relative_error < 1e-5 and len(entry.samples_ms) == 2
        assert entry.details["vs_p1_baseline"] == "emulated-1"
        assert entry.details["vs_p1"] == pytest.approx(entry.median_ms / entries["emulated-1"].median_ms)
    assert [team.world_size for team in made] == closed == [1, 2, 8]  # one team per entry, closed afterwards
    assert made[2].sizes == {"max_tokens": 4, "hidden": 64, "top_k": 2, "local_experts": 1,
                             "dtype": torch.float32, "device": torch.device("cpu")}
    for name, ranks in (("emulated-2", 2), ("emulated-8", 8)):
        details = entries[name].details
        assert details["payload_efficiency"] == 1.0 and details["bytes_sent_per_rank"] == [5 * 64 * 4] * ranks
        assert details["buffer_bytes_per_rank"] == 4096
    assert entries["single"].details["max_bytes_sent_per_rank"] is None  # no team, no traffic
    assert "vs_p1" in entries["reference"].details and result.settings["entries"] == options.entries


@pytest.mark.gpu
def test_expert_parallel_quick_run_on_gpu(tmp_path):
    """Every in-process entry runs and matches the reference; the MPS rows run or say why they cannot."""
    code = main(["--suite", "expert-parallel", "--device", "cuda", "--configs", "64,64,128,8,2", "--repeats", "5",
                 "--warmup", "2", "--output", str(tmp_path)])
    results = json.loads((tmp_path / "expert-parallel.json").read_text())
    for config in results["configs"]:
        entries = {entry["name"]: entry for entry in config["entries"]}
        for name in ("single", "emulated-1", "emulated-2", "emulated-4", "emulated-8", "reference"):
            assert entries[name]["status"] == "ok", entries[name]
            assert entries[name]["correct"] is True, entries[name]
        for name in ("emulated-2", "emulated-4", "emulated-8"):
            assert entries[name]["details"]["payload_efficiency"] == pytest.approx(1.0), entries[name]
            assert entries[name]["details"]["vs_p1"] > 0
        assert entries["emulated-1"]["details"]["max_bytes_sent_per_rank"] == 0  # one rank sends nothing
        for name in ("mps-2", "mps-2-nvshmem", "mps-4", "mps-4-nvshmem"):
            entry = entries[name]
            assert entry["status"] in ("ok", "unavailable"), entry
            if entry["status"] != "ok":
                continue
            details = entry["details"]
            assert entry["correct"] is True and len(details["traffic"]) == details["world_size"], entry
            assert details["payload_efficiency"] == pytest.approx(1.0), entry
            # every byte of the nvshmem rows goes through NVSHMEM puts, none of the p2p rows'
            expected = details["bytes_sent_per_rank"] if name.endswith("-nvshmem") else [0] * details["world_size"]
            assert details["nvshmem_bytes_sent_per_rank"] == expected, entry
    assert code == 0


# ------------------------------------------------------------------------------------------------------------
# multi-gpu suite (CPU: registration, plan, derived metrics, refusal, and the NCCL baseline's exchange over
# gloo through the same harness; the real NCCL/NVSHMEM run needs >= 2 GPUs: see the gpu test below)

from flashdmoe.bench import multi_gpu

MG_ARGS = ["--suite", "multi-gpu", "--quick", "--repeats", "2", "--warmup", "0"]


def test_multi_gpu_suite_is_registered():
    suite = registry.get_suite("multi-gpu")
    assert list(suite.entry_names) == ["fused", "nccl"] and suite.validate is multi_gpu.validate_options
    assert suite.default_shapes == (BenchShape(8192, 2048, 2048, 32, 2),)
    assert suite.layout is multi_gpu.MULTI_GPU_LAYOUT
    assert "multi-gpu" in bench_cli.configure_parser(argparse.ArgumentParser()).format_help()
    assert "not yet run on multi-GPU hardware" in multi_gpu.__doc__


def _plan(gpus, shapes=None):
    return [(p.world_size, p.shape.tokens, p.shape.experts, p.studies) for p in multi_gpu.plan_configs(gpus, shapes)]


def test_multi_gpu_plan_for_8_4_3_and_2_gpus():
    weak = [(2, 8192, 32, ("weak",)), (4, 8192, 32, ("weak",))]
    assert _plan(8) == weak + [
        (8, 8192, 32, ("weak", "tokens", "experts")), (8, 4096, 32, ("tokens",)), (8, 16384, 32, ("tokens",)),
        (8, 8192, 8, ("experts",)), (8, 8192, 16, ("experts",)), (8, 8192, 64, ("experts",)),
        (8, 8192, 128, ("experts",))]
    assert _plan(16) == _plan(8)  # counts above 8 are not planned
    assert _plan(4)[:2] == [(2, 8192, 32, ("weak",)), (4, 8192, 32, ("weak", "tokens", "experts"))]
    assert [p[0] for p in _plan(4)] == [2] + [4] * 7
    assert _plan(3) == _plan(2) and [p[0] for p in _plan(2)] == [2] * 7
    for planned in multi_gpu.plan_configs(8):
        assert planned.shape.hidden == planned.shape.ffn == 2048 and planned.shape.top_k == 2
        assert planned.shape.experts % planned.world_size == 0
    custom = BenchShape(64, 64, 128, 8, 2)
    assert _plan(8, [custom]) == [(2, 64, 8, ("weak",)), (4, 64, 8, ("weak",)), (8, 64, 8, ("weak",))]
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        multi_gpu.plan_configs(1)
    planned = multi_gpu.plan_configs(8)[2]
    assert planned.shape_dict() == {"P": 8, "T/GPU": 8192, "H": 2048, "I": 2048, "E": 32, "k": 2}


def _mg_options(**changes):
    base = {"suite": "multi-gpu", "device": "cuda", "dtype": "bfloat16", "activation": "gelu",
            "shapes": list(multi_gpu.MULTI_GPU_SHAPES), "entries": ["fused", "nccl"]}
    return SuiteOptions(**(base | changes))


def test_multi_gpu_refuses_without_two_gpus(tmp_path, capsys):
    for found in (0, 1):
        with pytest.raises(ValueError, match=f"at least 2 CUDA GPUs .*found {found} visible GPU"):
            multi_gpu.validate_options(_mg_options(), gpu_count=found)
    with pytest.raises(ValueError, match="--device cpu: .* found 0 visible CUDA GPU"):
        multi_gpu.validate_options(_mg_options(device="cpu"), gpu_count=0)
    multi_gpu.validate_options(_mg_options(), gpu_count=8)  # accepted
    with pytest.raises(ValueError, match="E=12 is not divisible by P=8"):
        multi_gpu.validate_options(_mg_options(shapes=[BenchShape(64, 64, 64, 12, 2)]), gpu_count=8)
    with pytest.raises(ValueError, match="--dtype float32"):
        multi_gpu.validate_options(_mg_options(dtype="float32"), gpu_count=2)
    if torch.cuda.device_count() < 2:  # through the CLI: exit code 2, the count named, nothing written
        assert main([*MG_ARGS, "--device", "cpu", "--output", str(tmp_path)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "needs at least 2" in err and f"found {torch.cuda.device_count()} visible" in err
        assert not (tmp_path / "multi-gpu.json").exists()


def _mg_entry(name, p, median, err=1e-3, payload=None):
    details = {"world_size": p}
    if payload is not None:
        details["payload_efficiency"] = payload
    return EntryResult(name, multi_gpu.ENTRY_LABELS[name], "ok", median_ms=median, p10_ms=median, p90_ms=median,
                       max_relative_error=err, correct=True, details=details)


def _mg_config(p, tokens, experts, studies, fused_ms, nccl_ms):
    planned = multi_gpu.PlannedConfig(p, BenchShape(tokens, 2048, 2048, experts, 2), tuple(studies))
    entries = [_mg_entry("fused", p, fused_ms, payload=1.0),
               _mg_entry("nccl", p, nccl_ms) if nccl_ms else EntryResult("nccl", "x", "error", reason="boom")]
    return ConfigResult(planned.label, planned.shape_dict(), "gelu", "bfloat16", 1, 1, entries,
                        details={"studies": list(studies)})


def test_multi_gpu_derived_metrics():
    configs = [_mg_config(2, 8192, 32, ["weak"], 0.50, 2.0), _mg_config(4, 8192, 32, ["weak"], 0.52, 2.6),
               _mg_config(8, 8192, 32, ["weak", "tokens"], 0.55, 3.3), _mg_config(8, 4096, 32, ["tokens"], 0.3, None)]
    multi_gpu.add_derived(configs)
    fused = [c.entry("fused").details for c in configs]
    nccl = [c.entry("nccl").details for c in configs]
    assert fused[0]["overlap_efficiency"] == pytest.approx(1.0)
    assert fused[1]["overlap_efficiency"] == pytest.approx(0.50 / 0.52)
    assert fused[2]["overlap_efficiency"] == pytest.approx(0.50 / 0.55)
    assert nccl[2]["overlap_efficiency"] == pytest.approx(2.0 / 3.3)
    assert "overlap_efficiency" not in fused[3]  # not a weak-scaling configuration
    assert fused[2]["vs_nccl"] == pytest.approx(3.3 / 0.55) and nccl[2]["vs_nccl"] == pytest.approx(1.0)
    assert "vs_nccl" not in fused[3]  # the baseline failed there
    result = SuiteResult("multi-gpu", {"device": "cuda"}, {"notes": []}, configs)
    markdown = report.markdown_report(result, layout=multi_gpu.MULTI_GPU_LAYOUT)
    assert ("| P | T/GPU | H | I | E | k | study | entry | ms (median) | p10–p90 ms | TFLOP/s | % of ceiling | "
            "overlap eff. | vs NCCL | sent MB / rank (max) | payload eff. | max rel. error | status |") in markdown
    assert "| 8 | 8192 | 2048 | 2048 | 32 | 2 | weak,tokens | fused (NVSHMEM) | 0.550 |" in markdown
    assert "| 90.9% | 6.00x | – | 100.0% |" in markdown
    assert "error: boom" in markdown


def test_multi_gpu_entry_takes_the_slowest_rank_and_combines_checks():
    def rank(r, samples, error, scale, traffic):
        return RankOutcome(r, "ok", 0, info={
            "samples_ms": samples, "median_ms": float(np.median(samples)), "input_sets": 1, "traffic": [traffic],
            "check": {"max_abs_error": error, "max_abs_reference": scale, "compared_tokens": 5,
                      "near_tie_tokens": 1}})

    traffic = {"dispatch_bytes": 4 * 64 * 2, "combine_bytes": 64 * 2, "rows_routed_remote": 4}
    run = RunResult("nccl_forwards", 2, [rank(0, [1.0, 4.0, 2.0], 0.01, 2.0, traffic | {"rank": 0}),
                                      rank(1, [3.0, 1.0, 1.5], 0.03, 1.0, traffic | {"rank": 1})], 5.0, False)
    entry = multi_gpu.entry_from_run("nccl", run, 64, 2)
    assert entry.status == "ok" and entry.samples_ms == [3.0, 4.0, 2.0] and entry.median_ms == 3.0
    assert entry.max_relative_error == pytest.approx(0.03 / 2.0)
    assert entry.details["compared_tokens"] == 10 and entry.details["near_tie_tokens"] == 2
    assert entry.details["payload_efficiency"] == 1.0 and entry.details["max_bytes_sent_per_rank"] == 640
    hung = RunResult("timed_fused_forwards", 2, [run.ranks[0], RankOutcome(1, "hung", -9, phase="timed forwards",
                                                            kill_reason="still running")], 600.0, False)
    failed = multi_gpu.entry_from_run("fused", hung, 64, 2)
    assert failed.status == "error" and "rank 1: hung in phase 'timed forwards'" in failed.reason
    assert multi_gpu.combine_checks([{"max_abs_error": 0.0, "max_abs_reference": 0.0, "compared_tokens": 0,
                                      "near_tie_tokens": 0}])["max_relative_error"] == 0.0


def test_timed_fused_forwards_rotate_input_sets_after_a_checked_forward(monkeypatch, tmp_path):
    """The rank scenario's own code on the CPU: a one-rank stand-in team, the reference as the layer."""
    problem = Problem((20,), 64, 64, 4, 2, dtype="float32", near_tie_gap=0.0, seed=9)
    calls, barriers = [], []

    def reference_layer(problem, context, x, router, w1, w2):
        calls.append(x)
        return reference.moe(x, router, w1, w2, **problem.moe_kwargs())

    monkeypatch.setattr(scenarios, "team_moe", reference_layer)

    class StandInTeam:
        def barrier(self):
            barriers.append(True)

    params = {"problem": problem.to_dict(), "warmup": 1, "repeats": 4, "input_sets": 2}
    out = rank_scenarios.timed_fused_forwards(
        RankContext(0, 1, params, StandInTeam(), torch.device("cpu"), tmp_path, {}))
    assert barriers == [True] and out.info["input_sets"] == 2
    assert len(out.info["samples_ms"]) == 4 and out.info["p10_ms"] <= out.info["median_ms"] <= out.info["p90_ms"]
    sets = [problem.replace(seed=9 + s).rank_inputs(0).x for s in range(2)]
    # checked forward on set 0, one warm-up (set 0), then four timed runs rotating from set 1
    assert [next(i for i, x in enumerate(sets) if torch.equal(x, c)) for c in calls] == [0, 0, 1, 0, 1, 0]
    assert_normwise_close(out.tensors["y"], reference_results(problem)[0]["y"], FLOAT32_FORWARD_TOLERANCE)


def test_one_gpu_per_rank_needs_no_mps():
    with pytest.raises(ValueError, match="mps: one_gpu_per_rank=True"):
        run_ranks("selftest", 2, nvshmem=False, mps=True, one_gpu_per_rank=True)


def test_nccl_baseline_exchange_over_gloo_matches_the_reference():
    """The baseline scenario's real exchange (counts, rows and results through all_to_all_single, experts by
    torch._grouped_mm) on 3 CPU processes over gloo, through run_ranks, uneven tokens (one rank with 0)."""
    problem = Problem(tokens=(13, 0, 6), hidden=32, ffn=48, experts=6, top_k=2, activation="silu",
                      dtype="float32", seed=5)
    params = {"problem": problem.to_dict(), "backend": "gloo", "experts": "grouped_mm", "warmup": 1, "repeats": 2,
              "input_sets": 2, "return_output": True}
    run = run_ranks(rank_scenarios.nccl_forwards, 3, nvshmem=False, mps=False, one_gpu_per_rank=True, timeout_s=120,
                    params=params).check()
    inputs = problem.all_inputs()
    expected = reference.moe_expert_parallel([i.x for i in inputs], inputs[0].router_weight, [i.w1 for i in inputs],
                                             [i.w2 for i in inputs], top_k=2, activation="silu")
    for outcome, want, sent in zip(run.ranks, expected, expected_traffic(problem)):
        assert outcome.tensors["y"].shape == want.shape
        assert_normwise_close(outcome.tensors["y"], want, FLOAT32_FORWARD_TOLERANCE)
        assert len(outcome.info["samples_ms"]) == 2 and outcome.info["backend"] == "gloo"
        check = outcome.info["check"]
        assert check["max_abs_error"] < 1e-5 and check["compared_tokens"] + check["near_tie_tokens"] == want.shape[0]
        traffic = outcome.info["traffic"][0]
        for key in ("rows_routed_remote", "dispatch_bytes", "combine_bytes"):
            assert traffic[key] == sent[key], (key, traffic, sent)
    assert run.ranks[0].info["traffic"][0]["rows_routed_remote"] > 0
    entry = multi_gpu.entry_from_run("nccl", run, 32, 4)
    assert entry.status == "ok" and entry.max_relative_error < 1e-5 and entry.details["payload_efficiency"] == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the multi-gpu suite needs at least 2 GPUs")
def test_multi_gpu_quick_run_on_gpus(tmp_path):
    """Tiny shapes, weak scaling over the GPUs present: fused and NCCL rows run and match the reference."""
    code = main([*MG_ARGS, "--device", "cuda", "--output", str(tmp_path)])
    results = json.loads((tmp_path / "multi-gpu.json").read_text())
    counts = [p for p in (2, 4, 8) if p <= torch.cuda.device_count()]
    assert [c["shape"]["P"] for c in results["configs"]] == counts
    for config in results["configs"]:
        entries = {entry["name"]: entry for entry in config["entries"]}
        for name in ("fused", "nccl"):
            assert entries[name]["status"] == "ok", entries[name]
            assert entries[name]["correct"] is True, entries[name]
        assert entries["fused"]["details"]["payload_efficiency"] == pytest.approx(1.0)
        assert entries["fused"]["details"]["vs_nccl"] > 0
        assert entries["fused"]["details"]["overlap_efficiency"] > 0
    assert (tmp_path / "multi-gpu.png").read_bytes()[:8] == PNG_MAGIC
    assert code == 0
