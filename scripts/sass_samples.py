"""Nsight Compute's per-instruction samples of one kernel, summed by source file and line.

Reads the source page of an ``ncu`` report (``ncu --import R --page source --csv --print-source sass``),
and the same kernel's SASS with line information (``nvdisasm -g`` of the built module: the build compiles
with ``-lineinfo``). Prints, per source file and then for the top lines: how many distinct instructions ran
(their bytes are the code the launch had to fetch), the warp samples stalled on "no instruction" (waiting
for the instruction fetch), and all warp samples. A development probe (docs/perf-notes.md, "Instruction
fetch in the decode forward").

    python scripts/sass_samples.py --csv decode_sass.csv --module <flashdmoe_cuda...so> [--kernel TEXT] [--top N]

With --reasons, the samples by stall reason instead (the report's ``stall_*`` columns): per file, then the
top lines by samples with their leading reasons and opcodes; --sites counts the shared helpers' instructions
(common/: pipeline waits, wgmma, TMA) at the project's line that called them, so that the expert GEMMs' stage
waits, tensor-core waits and epilogue come apart (docs/perf-notes.md, "Where the warps wait").

The module must be the build the report profiled (same SASS): the kernel is the one whose name matches and
whose instruction count is the report's.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from flashdmoe.kernel import extension


def read_report(path: Path):
    """(kernel name, {column: index}, instruction rows, offset of each row from the kernel's first) of the
    CSV's one kernel."""
    rows = list(csv.reader(path.open()))
    kernel = rows[0][1] if rows and rows[0] and rows[0][0] == "Kernel Name" else ""
    header = next(r for r in rows if r and r[0] == "Address")
    at = {name: i for i, name in enumerate(header)}
    body = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
    base = int(body[0][at["Address"]], 16)
    return kernel, at, body, [int(r[at["Address"]], 16) - base for r in body]


def number(text: str) -> int:
    return int(text) if text.strip().isdigit() else 0


def report_rows(path: Path):
    """(kernel name, [(offset, executed, no-instruction samples, all samples)]) of the CSV's one kernel."""
    kernel, at, body, offsets = read_report(path)
    return kernel, [(offset, number(r[at["Instructions Executed"]]), number(r[at["stall_no_inst"]]),
                     number(r[at["Warp Stall Sampling (All Samples)"]])) for offset, r in zip(offsets, body)]


def reason_rows(path: Path):
    """(kernel name, [(offset, Counter of samples by stall reason, with "all"), opcode)]) of the CSV's kernel."""
    kernel, at, body, offsets = read_report(path)
    reasons = [name for name in at if name.startswith("stall_") and "Not Issued" not in name]
    out = []
    for offset, r in zip(offsets, body):
        counts = collections.Counter({name[len("stall_"):]: number(r[at[name]]) for name in reasons})
        counts["all"] = number(r[at["Warp Stall Sampling (All Samples)"]])
        words = r[at["Source"]].split() if "Source" in at else []
        out.append((offset, counts, next((w for w in words if not w.startswith("@")), "?")))
    return kernel, out


def print_reasons(args) -> None:
    kernel, rows = reason_rows(args.csv)
    name, table = line_table(args.module, args.kernel or kernel, len(rows))
    by_file, by_line = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    opcodes = collections.defaultdict(collections.Counter)
    for offset, counts, opcode in rows:
        chain = table.get(offset) or (("?", 0),)
        where = call_site(chain) if args.sites else chain[0]
        by_file[where[0]] += counts
        by_line[where] += counts
        opcodes[where][opcode] += counts["all"]
    total = sum(c["all"] for c in by_file.values()) or 1
    lead = lambda c, n: ", ".join(f"{k} {v}" for k, v in c.most_common(n + 1) if k != "all" and v)  # noqa: E731
    print(f"{name[:100]}: {total} samples")
    for file, counts in sorted(by_file.items(), key=lambda kv: -kv[1]["all"]):
        if counts["all"]:
            print(f"{file:<40} {counts['all']:>8} {100 * counts['all'] / total:5.1f}%  {lead(counts, 3)}")
    print(f"\ntop {args.top} lines by samples:")
    for (file, line), counts in sorted(by_line.items(), key=lambda kv: -kv[1]["all"])[:args.top]:
        ops = ",".join(f"{op}:{n}" for op, n in opcodes[(file, line)].most_common(3))
        print(f"{file + ':' + str(line):<40} {counts['all']:>8} {100 * counts['all'] / total:5.1f}%  "
              f"{lead(counts, 3)}  [{ops}]")


FRAME = re.compile(r'//## File "([^"]+)", line (\d+)')
OFFSET = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")
# The project's own code outside the shared helpers: where a helper's instruction was called from.
SITE_DIRS = ("moe/", "backward/", "comm/", "nvshmem/")


def section_chains(section: str) -> dict:
    """Offset -> inlining chain ((file, line), ...), innermost first, of one kernel's `nvdisasm -gi` listing
    (each instruction group is preceded by its frames, the innermost "inlined at" the next)."""
    chain, fresh, table = (), True, {}
    for line in section.splitlines():
        if m := FRAME.search(line):
            frame = (re.sub(r".*/(csrc|include)/", "", m.group(1)), int(m.group(2)))
            chain = (frame,) if fresh else chain + (frame,)
            fresh = False
        elif m := OFFSET.match(line):
            table[int(m.group(1), 16)] = chain
            fresh = True
    return table


def call_site(chain) -> tuple:
    """The chain's innermost frame in the project's own code outside common/ (a pipeline wait is counted where
    the GEMM or the gate called it), else its innermost frame."""
    return next((frame for frame in chain if frame[0].startswith(SITE_DIRS)), chain[0] if chain else ("?", 0))


def line_table(module: Path, kernel: str, instructions: int):
    """Offset -> inlining chain (section_chains) for the kernel of the module whose mangled name holds every
    word of ``kernel`` (template parameters like ``T3`` aside) and which has ``instructions`` instructions
    (that tells a training instance from the inference one of the same variant)."""
    tool = lambda name: str(extension.find_cuda_tool(name) or sys.exit(f"{name} not found"))  # noqa: E731
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([tool("cuobjdump"), "-xelf", "all", str(module.resolve())], cwd=scratch, check=True,
                       capture_output=True)
        words = [w for w in re.split(r"\W+", kernel) if w and w not in ("void", "int", "flashdmoe")
                 and not re.fullmatch(r"T\d+", w)]
        seen = []
        for cubin in sorted(Path(scratch).glob("*.cubin")):
            listing = subprocess.run([tool("nvdisasm"), "-gi", "-c", str(cubin)], check=True, capture_output=True,
                                     text=True).stdout
            for section in re.split(r"\n//-+ \.text\.", listing)[1:]:
                name = section.split(" ", 1)[0]
                if all(w in name for w in words):
                    table = section_chains(section)
                    if len(table) == instructions:
                        return name, table
                    seen.append(f"{name[:80]}... ({len(table)} instructions)")
    sys.exit(f"no kernel of {module} matches {kernel!r} with {instructions} instructions (the profiled build?); "
             f"by name: {seen}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--module", type=Path, required=True)
    parser.add_argument("--kernel", help="words of the kernel's name (default: the report's)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--reasons", action="store_true", help="samples by stall reason, per file and line")
    parser.add_argument("--sites", action="store_true",
                        help="with --reasons: count a shared helper's samples at its call site (call_site)")
    args = parser.parse_args(argv)
    if args.sites and not args.reasons:
        parser.error("--sites: only with --reasons")
    if args.reasons:
        print_reasons(args)
        return
    kernel, rows = report_rows(args.csv)
    name, table = line_table(args.module, args.kernel or kernel, len(rows))
    by_file, by_line = collections.defaultdict(lambda: [0, 0, 0]), collections.defaultdict(lambda: [0, 0, 0])
    for offset, executed, no_instruction, samples in rows:
        where = (table.get(offset) or (("?", 0),))[0]
        for key, sums in ((where[0], by_file), (where, by_line)):
            sums[key][0] += executed > 0
            sums[key][1] += no_instruction
            sums[key][2] += samples
    ran = sum(v[0] for v in by_file.values())
    print(f"{name[:100]}: {ran} of {len(rows)} instructions ran ({16 * ran / 1024:.1f} KB); "
          f"{sum(v[1] for v in by_file.values())} of {sum(v[2] for v in by_file.values())} samples with no instruction")
    print(f"{'file':<40} {'ran':>6} {'KB':>6} {'no-inst':>8} {'samples':>8}")
    for file, (count, no_instruction, samples) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        if count:
            print(f"{file:<40} {count:>6} {16 * count / 1024:>6.1f} {no_instruction:>8} {samples:>8}")
    print(f"\ntop {args.top} lines by no-instruction samples:")
    for (file, line), (count, no_instruction, samples) in sorted(by_line.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{file + ':' + str(line):<40} {count:>6} {'':>6} {no_instruction:>8} {samples:>8}")


if __name__ == "__main__":
    main()
