"""What ``distlib bench store`` prints and writes: the table of rows (with torch's figures, the
speed-up and the targets when torch was measured), the single client's latencies, the
barrier's phases and paired speed-up, the connect storm's histograms, the header and the JSON
report (schema 1).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence

from distlib import command
from .results import DISTLIB, MISS, NOT_MEASURED, PASS, TORCH, Row
from .store_security import SecurityBench
from .tables import Table, environment, fmt_num, fmt_seconds, fmt_speedup, fmt_value, print_block
from .timing import PairedRatio, median


class StoreReport:
    """The report half of StoreBench (store_measure.py): tables and lines from what the
    sections measured. Reads ``impls``, ``rows``, ``barrier_pairs``, ``storm_details``,
    ``transports`` and ``security_bench``."""

    impls: List[str]
    rows: List[Row]
    barrier_pairs: Dict[str, PairedRatio]
    storm_details: Dict[str, List[Dict[str, Any]]]
    #: implementation -> the transport its clients used (the JSON's environment)
    transports: Dict[str, str]
    #: the security section's results; None when it did not run
    security_bench: Optional[SecurityBench]

    def table(self) -> str:
        has_ref = TORCH in self.impls
        headers = ["load", "unit", "distlib"] + (["torch", "speed-up", "target", "result"] if has_ref
                                                  else ["target", "result"])
        table = Table(headers, "llrrrll" if has_ref else "llrll")
        section = None
        for row in self.rows:
            if row.section != section:
                if section is not None:
                    table.separator()
                section = row.section
                table.add(f"[{section}]", *[""] * (len(headers) - 1))
            ours = "FAILED" if DISTLIB in row.errors else fmt_value(row.median(DISTLIB), row.unit)
            target = row.target.text if row.target else ""
            result = row.result() if row.target else ""
            if has_ref:
                theirs = "FAILED" if TORCH in row.errors else fmt_value(row.median(TORCH), row.unit)
                table.add("  " + row.name, row.unit if row.unit != "s" else "time", ours, theirs,
                          fmt_speedup(row.speedup()), target, result)
            else:
                if result == NOT_MEASURED:
                    result = "n/a (no torch)"
                table.add("  " + row.name, row.unit if row.unit != "s" else "time", ours, target, result)
        return table.render()

    def latency_table(self) -> Optional[str]:
        rows = [r for r in self.rows if r.section == "single client"]
        if not rows:
            return None
        table = Table(["single client, median us per call"] + [f"{impl} p50" for impl in self.impls]
                      + [f"{impl} p90" for impl in self.impls])
        for row in rows:
            cells = []
            for q in ("p50_us", "p90_us"):
                for impl in self.impls:
                    vals = [d[q] for d in row.details.get(impl, [])]
                    cells.append(fmt_num(median(vals)) if vals else "-")
            table.add("  " + row.name, *cells)
        return table.render()

    def barrier_lines(self) -> List[str]:
        """Where a barrier round's time goes, per implementation: the medians over all
        rounds of the arrival (first ADD sent to the last arriver's SET) and the release
        (that SET to the last rank through)."""
        lines = []
        for row in self.rows:
            if row.section != "barrier":
                continue
            for impl in self.impls:
                details = [d for d in row.details.get(impl, []) if "arrival_s" in d]
                if details:
                    arrival = median([d["arrival_s"] for d in details])
                    release = median([d["release_s"] for d in details])
                    lines.append(f"  {row.name.split(':')[0]}, {impl}: arrival {fmt_seconds(arrival)}, "
                                 f"release {fmt_seconds(release)}")
            paired = self.barrier_pairs.get(row.name)
            if paired is not None and paired.pairs:
                lines.append(f"  {row.name.split(':')[0]}, speed-up over {paired.pairs} paired iterations "
                             f"(torch time / distlib time, each pair back to back): median "
                             f"{fmt_speedup(paired.median)}, 95% CI {fmt_speedup(paired.low)} to "
                             f"{fmt_speedup(paired.high)}")
        return lines

    def storm_lines(self) -> List[str]:
        lines = []
        for impl, details in self.storm_details.items():
            for rnd, d in enumerate(details):
                hist = ", ".join(f"{k}: {v}" for k, v in d["histogram"].items())
                failed = f", {d['failed']} FAILED" if d["failed"] else ""
                lines.append(f"  {impl} round {rnd + 1}: constructor median {fmt_seconds(d['median_s'])}, "
                             f"max {fmt_seconds(d['max_s'])}; histogram {hist}{failed}")
        return lines

    def summary(self) -> Dict[str, int]:
        counts = {PASS: 0, MISS: 0, NOT_MEASURED: 0}
        for row in self.rows:
            if row.target:
                counts[row.result()] += 1
        return counts


def finish(args: argparse.Namespace, bench: StoreReport, impls: Sequence[str], torch_version: Optional[str], why_not: str,
           failures: List[str], wall: float) -> int:
    """Print the header, the tables and the failures; write the JSON; the exit status (1 for a
    failure, or a miss under --fail-on-miss)."""
    out = command.text_stream(args.json)
    with_torch = TORCH in impls
    env = environment({"torch_backend": args.torch_backend if with_torch else None,
                       "distlib_transport": args.distlib_transport,
                       "client_transports": bench.transports})
    header = [
        f"distlib bench store: distlib {env['distlib']}"
        + (f" vs torch {torch_version} ({args.torch_backend} server)" if with_torch else
           f" (torch not measured: {why_not})"),
        f"{env['nproc']} CPUs ({env['cpu_model']}), Python {env['python']}, {env['platform']}; "
        + (f"pinned to CPUs {','.join(map(str, args.pin))}" if args.pin else "not pinned")
        + f"; servers and clients in separate processes; median of {args.rounds} interleaved round(s); "
          f"{wall:.0f} s",
        "transport: distlib clients "
        + ("over TCP (--distlib-transport tcp)" if args.distlib_transport == "tcp" else
           "over the server's same-host UNIX socket (the default; --distlib-transport tcp for TCP)")
        + "; torch clients over TCP; barrier ranks over TCP for both",
    ]
    print("\n".join(header), file=out)
    print_block(out, bench.table() if bench.rows else None)
    if bench.security_bench is not None:
        print_block(out, bench.security_bench.table() + "\n" + "\n".join(bench.security_bench.lines()))
    print_block(out, bench.latency_table())
    print_block(out, "barrier rounds, median (arrival: first ADD to done set; release: done set to the last rank "
                     "through):", bench.barrier_lines())
    print_block(out, "connect storm, per round:", bench.storm_lines())
    counts = bench.summary()
    print(file=out)
    print("speed-up = how many times better distlib is (ops/s: distlib/torch; times: torch/distlib). "
          f"targets: {counts[PASS]} PASS, {counts[MISS]} MISS"
          + (f", {counts[NOT_MEASURED]} not measurable without torch" if counts[NOT_MEASURED] else ""),
          file=out)
    for failure in failures:
        print(f"FAILED: {failure}", file=out)
    out.flush()

    if args.json:
        command.write_json(args.json, {
            "benchmark": "distlib bench store",
            "schema": 1,
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "implementations": impls,
            "rows": [row.to_json(impls) for row in bench.rows],
            "connect_storm": bench.storm_details,
            "barrier_paired_speedup": {name: p.to_json() for name, p in bench.barrier_pairs.items()},
            "security": bench.security_bench.json_rows() if bench.security_bench is not None else None,
            "targets": counts,
            "failures": failures,
            "wall_seconds": round(wall, 3),
        })
    if failures:
        return 1
    if args.fail_on_miss and counts[MISS]:
        return 1
    return 0
