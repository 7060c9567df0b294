"""``flashdmoe bench --suite training``: the CPU run end to end through the CLI, the FLOP accounting, the
gradient check, a failing entry reported in its row, the phase timer; on a GPU one tiny shape with every
entry (the captured step included)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from rich.console import Console

from conftest import test_seed
from flashdmoe import cli, numerics
from flashdmoe.bench import metrics, registry, timing, training
from flashdmoe.bench.results import BenchShape
from flashdmoe.bench.suite import SuiteOptions

ENTRY_NAMES = ["flashdmoe", "flashdmoe_graph", "grouped_mm"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK = ["--device", "cpu", "--quick", "--repeats", "3", "--warmup", "1", "--input-sets", "2"]


def _bench(*arguments: str) -> int:
    return cli.main(["bench", "--suite", "training", *arguments])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, request):
    """``flashdmoe bench --suite training --device cpu --quick``: (exit code, output dir, JSON)."""
    output = tmp_path_factory.mktemp("bench-training")
    code = _bench(*QUICK, "--seed", str(test_seed(request.node.nodeid)), "--output", str(output))
    return code, output, json.loads((output / "training.json").read_text())


def test_suite_is_registered_with_its_layout():
    suite = registry.get_suite("training")
    assert suite is training.SUITE and suite.layout is training.TRAINING_LAYOUT
    assert list(suite.entry_names) == ENTRY_NAMES
    assert suite.activation is None  # each shape carries its own
    # issue 14's three shapes, then docs/design.md §12's four (the paper's problem is in both lists)
    assert [(s.tokens, s.hidden, s.ffn, s.experts, s.top_k, a) for s, a in training.TRAINING_CASES] == [
        (8192, 2048, 2048, 32, 2, "gelu"), (8192, 2048, 768, 128, 8, "swiglu"), (4096, 4096, 14336, 8, 2, "swiglu"),
        (16384, 2048, 2048, 64, 2, "gelu"), (16384, 4096, 1024, 128, 2, "gelu"), (4096, 2048, 2048, 64, 2, "gelu"),
        (128, 4096, 1408, 64, 6, "gelu"),
    ]


def test_quick_cpu_run_writes_reports_and_times_every_entry(quick_run):
    code, output, results = quick_run
    assert code == 0
    assert results["suite"] == "training" and results["ceiling_tflops"] is None
    assert (output / "training.png").read_bytes()[:8] == PNG_MAGIC
    markdown = (output / "training.md").read_text()
    assert "| T | H | I | E | k | act | entry | fwd ms | bwd ms | fwd+bwd ms |" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(training.QUICK_CASES) * len(ENTRY_NAMES)
    assert [c["shape"] for c in results["configs"]] == [
        {**shape.to_dict(), "act": activation} for shape, activation in training.QUICK_CASES
    ]
    for config in results["configs"]:
        entries = {entry["name"]: entry for entry in config["entries"]}
        assert list(entries) == ENTRY_NAMES
        assert entries["flashdmoe_graph"]["status"] == "unavailable"
        assert "CUDA graphs need a CUDA device" in entries["flashdmoe_graph"]["reason"]
        assert entries["flashdmoe"]["details"]["backend"] == "reference"  # the CPU path of the public call
        assert config["input_sets"] == 2
        for name in ("flashdmoe", "grouped_mm"):
            entry = entries[name]
            assert entry["status"] == "ok", entry["reason"]
            phases = [entry["details"]["forward"], entry["details"]["backward"], entry]
            for phase in phases:
                assert len(phase["samples_ms"]) == 3
                assert all(math.isfinite(sample) and sample > 0 for sample in phase["samples_ms"])
                assert phase["p10_ms"] <= phase["median_ms"] <= phase["p90_ms"]
            # per run, forward + backward = the whole step (each sample is one run's three readings)
            for forward, backward, whole in zip(*(phase["samples_ms"] for phase in phases)):
                assert forward + backward == pytest.approx(whole, rel=1e-6, abs=1e-6)
            details = config["details"]
            assert entry["details"]["forward"]["tflops"] == pytest.approx(
                details["forward_flops"] / (entry["details"]["forward"]["median_ms"] * 1e-3) / 1e12)
            assert entry["details"]["backward"]["tflops"] == pytest.approx(
                details["backward_flops"] / (entry["details"]["backward"]["median_ms"] * 1e-3) / 1e12)
            assert entry["tflops"] == pytest.approx(config["flops"] / (entry["median_ms"] * 1e-3) / 1e12)
            assert entry["speedup_over_grouped_mm"] == pytest.approx(
                entries["grouped_mm"]["median_ms"] / entry["median_ms"])
            assert entry["correct"] is True
            assert entry["error_tolerance"] == numerics.backward_tolerance("bfloat16")
            errors = entry["details"]["errors"]
            assert errors["y"] <= numerics.kernel_tolerance("bfloat16")
            assert entry["max_relative_error"] == max(e for k, e in errors.items() if k != "y" and e is not None)


def test_flop_accounting_matches_a_hand_count(quick_run):
    _, _, results = quick_run
    gelu, swiglu = results["configs"]
    assert gelu["shape"] == {"T": 64, "H": 64, "I": 128, "E": 8, "k": 2, "act": "gelu"}
    # forward: 2*T*k*H*I*2 (two expert GEMMs) = 4_194_304, + router 2*T*H*E = 65_536
    assert gelu["details"]["forward_flops"] == 4_259_840
    # backward: twice the expert GEMMs, 8_388_608, + router 4*T*E*H = 131_072
    assert gelu["details"]["backward_flops"] == 8_519_680
    assert gelu["flops"] == 4_259_840 + 8_519_680
    assert swiglu["shape"] == {"T": 40, "H": 64, "I": 64, "E": 4, "k": 1, "act": "swiglu"}
    # swiglu: three expert GEMMs' worth, 2*40*1*64*64*3 = 983_040; router 2*40*64*4 = 20_480
    assert swiglu["details"]["forward_flops"] == 983_040 + 20_480
    assert swiglu["details"]["backward_flops"] == 2 * 983_040 + 4 * 40 * 4 * 64


def test_router_gradient_is_not_checked_where_it_is_zero_by_construction(quick_run):
    _, _, results = quick_run
    gelu, swiglu = results["configs"]  # k = 2, then k = 1 with normalised weights (all 1: no router gradient)
    assert gelu["entries"][0]["details"]["errors"]["router_weight"] is not None
    assert swiglu["entries"][0]["details"]["errors"]["router_weight"] is None


def _options(**overrides) -> SuiteOptions:
    values = dict(suite="training", device="cpu", dtype="float32", activation=None,
                  shapes=[BenchShape(24, 64, 64, 4, 2)], entries=list(ENTRY_NAMES), repeats=2, warmup=0,
                  input_sets=2,
                  seed=test_seed("training-options"), console=Console(quiet=True))
    values.update(overrides)
    return SuiteOptions(**values)


def test_activation_option_and_shapes_outside_the_table():
    # --configs shapes the suite does not list run with gelu; --activation applies to every shape
    assert training.activation_for(BenchShape(24, 64, 64, 4, 2), _options()) == "gelu"
    assert training.activation_for(BenchShape(8192, 2048, 768, 128, 8), _options()) == "swiglu"
    assert training.activation_for(BenchShape(8192, 2048, 768, 128, 8), _options(activation="relu")) == "relu"


def test_an_activation_per_configs_entry():
    # 'T,H,I,E,k,act' entries: their own activation first, then --activation, then the suite's pairing
    shapes = [BenchShape(8192, 2048, 2048, 32, 2), BenchShape(8192, 2048, 768, 128, 8), BenchShape(24, 64, 64, 4, 2)]
    own = _options(shapes=shapes, shape_activations=("swiglu", None, None))
    assert [training.activation_for(shape, own, i) for i, shape in enumerate(shapes)] == ["swiglu", "swiglu", "gelu"]
    forced = _options(shapes=shapes, shape_activations=("swiglu", None, None), activation="relu")
    assert [training.activation_for(shape, forced, i) for i, shape in enumerate(shapes)] == ["swiglu", "relu", "relu"]


def test_wrong_gradients_and_a_failing_capture_are_reported_in_their_rows(monkeypatch):
    original = training.prepare_flashdmoe

    def doubled_dy(inputs, dy, problem):  # every gradient twice too large
        return original(inputs, 2 * dy, problem)

    def failing_capture(inputs, dy, problem):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(training, "prepare_flashdmoe", doubled_dy)
    monkeypatch.setattr(training, "prepare_flashdmoe_graph", failing_capture)
    result = training.run_training(_options(activation="silu"))
    entries = {entry.name: entry for entry in result.configs[0].entries}
    assert result.configs[0].activation == "silu"
    wrong = entries["flashdmoe"]
    assert wrong.status == "ok" and wrong.correct is False
    assert wrong.max_relative_error == pytest.approx(1.0, rel=1e-3)  # ||2g - g|| / ||g||
    assert wrong.details["errors"]["y"] < metrics.ERROR_TOLERANCES["float32"]  # the forward is right
    graph = entries["flashdmoe_graph"]
    assert graph.status == "error"
    assert graph.reason == "RuntimeError: operation not permitted when stream is capturing"
    baseline = entries["grouped_mm"]
    assert baseline.status == "ok" and baseline.correct is True  # the suite went on
    assert baseline.error_tolerance == metrics.gradient_tolerance("float32", 64)


def test_gradient_tolerance_and_error():
    assert metrics.gradient_tolerance("bfloat16", 16384) == numerics.backward_tolerance("bfloat16")
    assert metrics.gradient_tolerance("float32", 512) == numerics.reorder_tolerance("float32", 512, depth=4)
    want = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    assert metrics.normwise_error(want + torch.tensor([[0.0, 0.5], [0.0, 0.0]]), want) == pytest.approx(0.1)
    assert metrics.normwise_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert metrics.normwise_error(torch.ones(2), torch.zeros(2)) == math.inf
    with pytest.raises(ValueError, match="got.shape"):
        metrics.normwise_error(torch.zeros(3), torch.zeros(2))


def test_measure_phases_times_each_phase_and_the_whole_run():
    calls = []

    def sleeper(tag, seconds):
        def run():
            calls.append(tag)
            time.sleep(seconds)
        return run

    timings = timing.measure_phases(
        [(sleeper("a-fwd", 0.002), sleeper("a-bwd", 0.006)), (sleeper("b-fwd", 0.002), sleeper("b-bwd", 0.006))],
        device="cpu", warmup=1, repeats=4,
    )
    assert calls == ["a-fwd", "a-bwd", "b-fwd", "b-bwd"] * 2 + ["a-fwd", "a-bwd"]  # 1 warm-up + 4, rotated
    forward, backward = timings.phases
    assert all(2.0 <= sample < 6.0 for sample in forward.samples_ms)
    assert all(sample >= 6.0 for sample in backward.samples_ms)
    for f, b, whole in zip(forward.samples_ms, backward.samples_ms, timings.total.samples_ms):
        assert whole == pytest.approx(f + b, rel=1e-6)
    with pytest.raises(ValueError, match="same number"):
        timing.measure_phases([(sleeper("a", 0),), (sleeper("b", 0), sleeper("c", 0))], device="cpu")
    with pytest.raises(ValueError, match="repeats=0"):
        timing.measure_phases([(sleeper("a", 0),)], device="cpu", repeats=0)


@pytest.mark.gpu
def test_tiny_shape_on_gpu(tmp_path, seed):
    code = _bench("--device", "cuda", "--configs", "256,128,128,8,2", "--repeats", "5", "--warmup", "2",
                  "--seed", str(seed), "--output", str(tmp_path))
    results = json.loads((tmp_path / "training.json").read_text())
    assert results["machine"]["gpu_name"] and results["ceiling_tflops"] > 10
    (config,) = results["configs"]
    entries = {entry["name"]: entry for entry in config["entries"]}
    assert list(entries) == ENTRY_NAMES
    for name, entry in entries.items():
        assert entry["status"] == "ok", (name, entry["reason"])
        assert entry["correct"] is True, (name, entry["details"]["errors"])
        for phase in (entry["details"]["forward"], entry["details"]["backward"], entry):
            assert all(math.isfinite(sample) and sample > 0 for sample in phase["samples_ms"])
        assert name == "grouped_mm" or entry["details"]["backend"] == "cuda"
        if name != "flashdmoe_graph":
            assert entry["details"]["peak_step_bytes"] > 0
    assert code == 0
