"""Where a kernel's warps wait, from Nsight Compute's per-instruction SASS page.

    ncu --section SourceCounters --section WarpStateStats --import-source no \\
        --page source --print-source sass --csv -k regex:KERNEL -c 1 python3 ... > k.csv
    python bench/sass_hotspots.py k.csv

ncu samples each warp's state every few cycles and charges the sample to the instruction
the warp is at; the CSV has one row per SASS instruction with its executed count and its
samples by stall reason. Instructions executed the same number of times run together (a
loop body, a branch taken once a split), so grouping by that count shows which part of the
kernel the time is spent in, and with what reason, without source line info (MLX builds its
kernels without it). That is how the attention fold's serial scratch reads showed up: 2 %
of the instructions, 20 % of the samples, all waiting on memory (history.md, 2026-12-06).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    address: str
    source: str  # the SASS text, predicate included
    executed: int
    samples: int
    stalls: Counter[str] = field(default_factory=Counter)  # reason -> samples

    @property
    def opcode(self) -> str:
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0] if words else ""


@dataclass
class Kernel:
    name: str
    instructions: list[Instruction]

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)


def _number(text: str) -> int:
    text = text.replace(",", "").strip()
    try:
        return int(float(text))
    except ValueError:
        return 0


def read(path: Path) -> list[Kernel]:
    """The kernels of an ncu source-page CSV (one block each: a "Kernel Name" line, the
    header, a row per instruction); lines that are not CSV (ncu's and the program's own
    output) are skipped."""
    kernels: list[Kernel] = []
    header: list[str] | None = None
    for row in csv.reader(line for line in path.read_text().splitlines()
                          if line.startswith('"')):
        if row and row[0] == "Kernel Name":
            kernels.append(Kernel(row[1] if len(row) > 1 else "", []))
            header = None
        elif row and row[0] == "Address":
            header = row
            if not kernels:
                kernels.append(Kernel("", []))
        elif header is not None:
            cells = dict(zip(header, row, strict=False))
            stalls = Counter({k[len("stall_"):]: _number(v) for k, v in cells.items()
                              if k.startswith("stall_") and "(Not Issued)" not in k
                              and _number(v) > 0})
            kernels[-1].instructions.append(Instruction(
                cells.get("Address", ""), cells.get("Source", "").strip(),
                _number(cells.get(EXECUTED, "0")), _number(cells.get(SAMPLES, "0")), stalls))
    return kernels


@dataclass
class Group:
    executed: int  # times each of its instructions ran (all warps)
    instructions: list[Instruction]

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    def stalls(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for i in self.instructions:
            total.update(i.stalls)
        return total

    def opcodes(self) -> list[tuple[str, int, int]]:
        """(opcode, instructions, samples), most samples first."""
        count: Counter[str] = Counter()
        samples: Counter[str] = Counter()
        for i in self.instructions:
            count[i.opcode] += 1
            samples[i.opcode] += i.samples
        return [(op, count[op], samples[op]) for op, _ in samples.most_common()]


def groups(kernel: Kernel) -> list[Group]:
    """The kernel's instructions grouped by executed count, most samples first."""
    by_count: dict[int, list[Instruction]] = {}
    for i in kernel.instructions:
        by_count.setdefault(i.executed, []).append(i)
    return sorted((Group(n, ins) for n, ins in by_count.items()),
                  key=lambda g: g.samples, reverse=True)


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:5.1f} %" if whole else "    - "


def report(kernel: Kernel, top_groups: int = 6, top_ops: int = 12, top_lines: int = 12) -> str:
    total = kernel.samples
    executed = sum(i.executed for i in kernel.instructions)
    out = [f"{kernel.name[:120]}",
           f"  {len(kernel.instructions)} instructions, {executed:,} executed (warp level), "
           f"{total:,} stall samples"]
    found = groups(kernel)
    out.append("  by executed count (a loop body, a branch's block):")
    for g in found[:top_groups]:
        reasons = ", ".join(f"{r} {_share(n, g.samples).strip()}"
                            for r, n in g.stalls().most_common(3))
        out.append(f"    x{g.executed:>11,}  {len(g.instructions):5d} instructions  samples "
                   f"{_share(g.samples, total)}  ({reasons})")
    if found:
        hottest = found[0]
        out.append(f"  opcodes of the hottest group (x{hottest.executed:,}):")
        for op, n, s in hottest.opcodes()[:top_ops]:
            out.append(f"    {op:28s} {n:5d}  samples {_share(s, total)}")
    out.append("  hottest instructions:")
    for i in sorted(kernel.instructions, key=lambda i: i.samples, reverse=True)[:top_lines]:
        reasons = ", ".join(f"{r} {n}" for r, n in i.stalls.most_common(2))
        out.append(f"    {i.address[-6:]:>6}  x{i.executed:>11,}  {_share(i.samples, total)}  "
                   f"{i.source[:56]:56s}  {reasons}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv output")
    p.add_argument("--groups", type=int, default=6, help="executed-count groups shown")
    p.add_argument("--ops", type=int, default=12, help="opcodes of the hottest group shown")
    p.add_argument("--lines", type=int, default=12, help="hottest instructions shown")
    args = p.parse_args(argv)
    kernels = read(args.csv)
    if not any(k.instructions for k in kernels):
        print(f"{args.csv}: no SASS rows (was ncu run with --page source --csv?)",
              file=sys.stderr)
        return 1
    print("\n\n".join(report(k, args.groups, args.ops, args.lines)
                      for k in kernels if k.instructions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
