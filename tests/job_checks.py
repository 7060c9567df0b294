"""Checks shared by the main-job tests (test_cli, test_ray): a results dict has exactly the documented
schema (flashdmoe.job.results), whichever executor produced it."""

from __future__ import annotations

from pathlib import Path

from flashdmoe.config import MoEConfig
from flashdmoe.job import results as schema
from flashdmoe.job.verification import TENSORS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_results_schema(results: dict, *, executor: str, steps: int, world_size: int, written: bool = True) -> None:
    """``results`` has every documented key at every level and no other, with values consistent with a run of
    ``steps`` steps on ``world_size`` ranks by ``executor``; with ``written``, results.json and latency.png exist."""
    assert set(results) == set(schema.RESULTS_FIELDS)
    assert results["schema_version"] == schema.SCHEMA_VERSION
    config = MoEConfig.from_dict(results["config"])  # round-trips
    assert config.world_size == world_size

    run = results["run"]
    assert set(run) == set(schema.RUN_FIELDS)
    assert run["executor"] == executor and run["world_size"] == world_size and run["steps"] == steps
    assert run["backend"] in ("reference", "cuda") and run["requested_backend"] in ("auto", "reference", "cuda")
    assert run["transport"] in ("gloo", "nvshmem", "emulated", "single")
    assert run["startup_s"] > 0 and run["wall_s"] > 0

    assert [worker["rank"] for worker in results["workers"]] == list(range(world_size))
    for worker in results["workers"]:
        assert set(worker) == set(schema.WORKER_FIELDS)
        assert set(worker["mps"]) == {"pipe_dir", "log_dir", "thread_percentage"}
        assert worker["generation"] >= 1 and worker["pid"] > 0

    assert [record["step"] for record in results["steps"]] == list(range(steps))
    for record in results["steps"]:
        assert set(record) == set(schema.STEP_FIELDS)
        assert record["attempts"] >= 1 and record["latency_ms"] > 0 and record["tokens_per_s"] > 0
        assert record["tokens"] == config.tokens_per_rank * world_size
        assert [entry["rank"] for entry in record["ranks"]] == list(range(world_size))
        for entry in record["ranks"]:
            assert set(entry) == set(schema.RANK_STEP_FIELDS)
            assert entry["tokens"] == config.tokens_per_rank
        assert record["dropped"] == sum(entry["dropped"] for entry in record["ranks"])

    metrics = results["metrics"]
    assert set(metrics) == set(schema.METRICS_FIELDS)
    assert metrics["steps_in_median"] == (steps - 1 if steps > 1 else 1)
    assert metrics["latency_ms_median"] > 0 and metrics["tokens_per_s"] > 0 and metrics["tflops"] > 0
    assert metrics["peak_memory_bytes"] > 0
    assert [entry["rank"] for entry in metrics["per_rank"]] == list(range(world_size))
    for entry in metrics["per_rank"]:
        assert set(entry) == set(schema.RANK_METRICS_FIELDS)

    verification = results["verification"]
    assert set(verification) == set(schema.VERIFICATION_FIELDS)
    if verification["enabled"]:
        assert verification["step"] == 0 and verification["tolerance"] > 0
        assert set(verification["tensors"]) == set(TENSORS)
        for entry in verification["tensors"].values():
            assert set(entry) == {"max_abs_err", "max_rel_err", "worst_rank"}
    else:
        assert all(verification[key] is None for key in schema.VERIFICATION_FIELDS if key != "enabled")

    for fault in results["faults"]:
        assert set(fault) == set(schema.FAULT_FIELDS)
    assert results["retries"] == sum(1 for fault in results["faults"] if fault["recovered"])
    assert set(results["environment"]) == {"flashdmoe", "torch", "python", "platform", "ray"}

    if written:
        assert Path(results["output"]).name == schema.RESULTS_FILENAME and Path(results["output"]).is_file()
        assert Path(results["plot"]).read_bytes()[:8] == PNG_MAGIC
    else:
        assert results["output"] is None and results["plot"] is None
