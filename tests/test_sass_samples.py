"""scripts/sass_samples.py's reading of an Nsight Compute source-page CSV (no GPU, no report needed)."""

import csv
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import sass_samples  # noqa: E402

REASONS = ["stall_long_sb", "stall_wait", "stall_barrier"]


def write_report(path: Path, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_no_inst"]
    header += REASONS + [name + " (Not Issued)" for name in REASONS]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "void flashdmoe::moe_forward_kernel<__nv_bfloat16>(...)"])
        out.writerow(header)
        for address, source, reasons in rows:
            out.writerow([hex(address), source, sum(reasons), 1, 0, *reasons, *(r // 2 for r in reasons)])


def test_reason_rows_sum_each_instructions_reasons(tmp_path):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    base = 0x7F0000001000
    rows = [(base + 16 * i, rng.choice(["@P1 BRA 0x10", "HGMMA.64x256x16.F32.BF16 R24", "SYNCS.PHASECHK.TRANS64 P1"]),
             [rng.randrange(0, 50) for _ in REASONS]) for i in range(40)]
    path = tmp_path / "report.csv"
    write_report(path, rows)
    kernel, parsed = sass_samples.reason_rows(path)
    assert kernel.startswith("void flashdmoe::moe_forward_kernel")
    assert [offset for offset, _, _ in parsed] == [16 * i for i in range(40)]
    for (_, source, reasons), (_, counts, opcode) in zip(rows, parsed):
        # the "(Not Issued)" columns are a subset of the issued ones' samples, not added to them
        assert [counts[name[len("stall_"):]] for name in REASONS] == reasons
        assert counts["all"] == sum(reasons)
        assert opcode == next(word for word in source.split() if not word.startswith("@"))


LISTING = """\t//## File "/repo/csrc/common/tma.cuh", line 34 inlined at "/repo/csrc/common/pipeline.cuh", line 33
\t//## File "/repo/csrc/common/pipeline.cuh", line 33 inlined at "/repo/csrc/moe/tile_gemm_tma.cuh", line 119
\t//## File "/repo/csrc/moe/tile_gemm_tma.cuh", line 119 inlined at "/repo/csrc/moe/expert_pipeline.cuh", line 212
\t//## File "/repo/csrc/moe/expert_pipeline.cuh", line 212
        /*0d70*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R47+URZ], R42 ;
        /*0d80*/               @P0 BRA `(.L_x_906) ;
\t//## File "/repo/csrc/common/wgmma.cuh", line 26 inlined at "/repo/csrc/moe/tile_gemm_tma.cuh", line 121
\t//## File "/repo/csrc/moe/tile_gemm_tma.cuh", line 121
        /*0d90*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
\t//## File "/usr/local/cuda/include/sm_20_intrinsics.hpp", line 151
        /*0da0*/                   LEA R13, R13, R12, 0x18 ;
"""


def test_inlining_chains_and_call_sites():
    table = sass_samples.section_chains(LISTING)
    assert sorted(table) == [0xD70, 0xD80, 0xD90, 0xDA0]
    wait = (("common/tma.cuh", 34), ("common/pipeline.cuh", 33), ("moe/tile_gemm_tma.cuh", 119),
            ("moe/expert_pipeline.cuh", 212))
    assert table[0xD70] == wait and table[0xD80] == wait  # a group's instructions share its frames
    assert table[0xD90] == (("common/wgmma.cuh", 26), ("moe/tile_gemm_tma.cuh", 121))
    # the helpers' instructions are counted where the GEMM called them; a header's stays where it is
    assert sass_samples.call_site(table[0xD70]) == ("moe/tile_gemm_tma.cuh", 119)
    assert sass_samples.call_site(table[0xD90]) == ("moe/tile_gemm_tma.cuh", 121)
    assert sass_samples.call_site(table[0xDA0]) == ("sm_20_intrinsics.hpp", 151)
