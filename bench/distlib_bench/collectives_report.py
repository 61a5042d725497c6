"""What ``distlib bench collectives`` prints and writes: one nccl-tests-style table per op,
the init and target tables, the summary line, the busbw plot (``--plot``) and the JSON report
(schema 1).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from distlib import command
from .collectives_ops import DISTLIB_GLOO, MPI4PY, SHORT, SIZE_MEANS, SweepPoint, algbw_gbs, busbw_factor
from .results import DISTLIB, MISS, NOT_MEASURED, PASS, TORCH, Row
from .tables import Table, fmt_num, fmt_seconds, fmt_speedup, print_block


def _finite(x: Optional[float]) -> Optional[float]:
    """x for JSON: None for NaN/inf (not measured, failed)."""
    return None if x is None or math.isnan(x) or math.isinf(x) else x


def _fmt_gbs(x: float) -> str:
    """GB/s with two decimals, as nccl-tests prints them."""
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


class CollectivesReport:
    """The report half of CollectivesBench (collectives_measure.py): tables and JSON from what
    the sweep measured. Reads ``args``, ``impls``, ``n``, ``mpi``, ``reference``,
    ``targets_spec``, ``points``, ``init_rows`` and ``targets``; collectives_cuda.py
    overrides ``_value_text``."""

    args: argparse.Namespace
    impls: List[str]
    n: int
    mpi: bool
    reference: str
    targets_spec: Dict[str, Any]
    points: List[SweepPoint]
    init_rows: List[Row]
    targets: List[Tuple[str, Row]]
    failures: List[str]

    def _impl_figures(self, point: SweepPoint, impl: str) -> Dict[str, Any]:
        row = point.row
        t = row.median(impl) if impl in row.values and impl not in row.errors else float("nan")
        alg = algbw_gbs(point.nbytes, t)
        factor = busbw_factor(point.op, self.n)
        return {"time_s": t, "algbw": alg, "busbw": alg * factor if not math.isnan(alg) else float("nan")}

    def op_tables(self) -> List[str]:
        """One nccl-tests-style table per op: size, count, type, time, algbw, busbw (distlib),
        then each other implementation's time and busbw (the reference's followed by the ratio,
        and with --backend mpi distlib's overhead over it), then whether results were checked."""
        others = [impl for impl in self.impls if impl != DISTLIB]
        out = []
        for op in self.args.ops:
            points = [p for p in self.points if p.op == op]
            if not points:
                continue
            factor = busbw_factor(op, self.n)
            headers = ["size (B)", "count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)"]
            for impl in others:
                headers += [f"{SHORT[impl]} (us)", f"{SHORT[impl]} busbw"]
                if impl == self.reference:
                    headers += ["ratio"] + (["overhead (us)"] if self.mpi else [])
            headers.append("check")
            table = Table(headers, "rrl" + "r" * (len(headers) - 4) + "l")
            busbws: Dict[str, List[float]] = {impl: [] for impl in self.impls}
            for p in points:
                cells: List[str] = [str(p.nbytes), str(p.count), self.args.dtype]
                problems = []
                for impl in self.impls:
                    if impl in p.row.errors:
                        word = "WRONG" if p.row.errors[impl].startswith("WRONG") else "FAILED"
                        problems.append(f"{SHORT.get(impl, impl)} {word}")
                        figs = [word, "-", "-"] if impl == DISTLIB else [word, "-"]
                    else:
                        fig = self._impl_figures(p, impl)
                        if not math.isnan(fig["busbw"]):
                            busbws[impl].append(fig["busbw"])
                        figs = [fmt_num(fig["time_s"] * 1e6), _fmt_gbs(fig["algbw"]), _fmt_gbs(fig["busbw"])]
                        if impl != DISTLIB:
                            figs = [figs[0], figs[2]]
                    cells += figs
                    if impl == self.reference:
                        cells.append(fmt_speedup(p.row.speedup(DISTLIB, self.reference)))
                        if self.mpi:
                            cells.append(fmt_num(p.row.excess(DISTLIB, self.reference) * 1e6))
                if problems:
                    cells.append(", ".join(problems))
                else:
                    cells.append("ok" if all(p.validated.get(impl) for impl in self.impls) else "-")
                table.add(*cells)
            avg = "; ".join(f"{impl} {sum(v) / len(v):.2f} GB/s" for impl, v in busbws.items() if v)
            title = (f"{op}{' (sum)' if op in ('all_reduce', 'reduce', 'reduce_scatter_tensor') else ''}, "
                     f"{self.args.dtype}, {self.n} ranks; {SIZE_MEANS[op]}; busbw = algbw x {factor:.3g}")
            out.append(f"{title}\n{table.render()}\navg busbw over sizes: {avg or '-'}")
        return out

    def _value_text(self, row: Row, impl: str) -> str:
        """A target row's figure: busbw for the bandwidth target, a time otherwise."""
        if impl in row.errors:
            return "WRONG" if row.errors[impl].startswith("WRONG") else "FAILED"
        value = row.median(impl)
        if math.isnan(value):
            return "-"
        busbw_bytes = self.targets_spec["all_reduce_busbw"]["applies"]["bytes"]
        if row.section == "all_reduce" and row.name == f"{busbw_bytes} B":
            return f"{algbw_gbs(busbw_bytes, value) * busbw_factor('all_reduce', self.n):.2f} GB/s"
        return fmt_seconds(value)

    def _row_table(self, labelled: Sequence[Tuple[str, Row]], first: str) -> str:
        ref = self.reference
        has_ref = ref in self.impls
        headers = [first, "distlib"] + ([SHORT[ref], "ratio"] if has_ref else []) + \
            (["overhead"] if has_ref and self.mpi else []) + ["target", "result"]
        table = Table(headers, "lr" + "r" * (len(headers) - 4) + "ll")
        for label, row in labelled:
            result = row.result(DISTLIB, ref) if row.target else ""
            if result == NOT_MEASURED:
                result = f"n/a (no {SHORT[ref]})" if not has_ref and row.values.get(DISTLIB) else "n/a"
            if row.note:
                result += f": {row.note}"
            cells = [label, self._value_text(row, DISTLIB)]
            if has_ref:
                cells += [self._value_text(row, ref), fmt_speedup(row.speedup(DISTLIB, ref))]
                if self.mpi:
                    excess = row.excess(DISTLIB, ref)
                    cells.append("-" if math.isnan(excess) else ("+" if excess >= 0 else "-") + fmt_seconds(abs(excess)))
            cells += [row.target.text if row.target else "", result]
            table.add(*cells)
        return table.render()

    def init_table(self) -> Optional[str]:
        if not self.init_rows:
            return None
        return self._row_table([(r.name, r) for r in self.init_rows], "init (env://, all ranks start together)")

    def targets_table(self) -> Optional[str]:
        if not self.targets:
            return None
        return self._row_table(self.targets, "target")

    def summary(self) -> Dict[str, int]:
        counts = {PASS: 0, MISS: 0, NOT_MEASURED: 0}
        for _, row in self.targets:
            counts[row.result(DISTLIB, self.reference)] += 1
        return counts

    def collectives_json(self) -> List[Dict[str, Any]]:
        out = []
        for p in self.points:
            entry: Dict[str, Any] = {
                "op": p.op, "bytes": p.nbytes, "count": p.count, "dtype": self.args.dtype, "ranks": self.n,
                "busbw_factor": busbw_factor(p.op, self.n),
            }
            for impl in self.impls:
                fig = self._impl_figures(p, impl)
                entry[impl] = {  # unrounded, so busbw can be recomputed from bytes and time_us
                    "time_us": _finite(fig["time_s"] * 1e6),
                    "algbw_gbs": _finite(fig["algbw"]),
                    "busbw_gbs": _finite(fig["busbw"]),
                    "rounds_us": [round(v * 1e6, 3) for v in p.row.values.get(impl, [])],
                    "per_rank_us": [d.get("per_rank_us") for d in p.row.details.get(impl, [])],
                    "validated": p.validated.get(impl),
                    "error": p.row.errors.get(impl),
                }
            has_ref = self.reference in self.impls
            entry["ratio"] = _finite(p.row.speedup(DISTLIB, self.reference)) if has_ref else None
            if self.mpi:
                entry["overhead_us"] = _finite(p.row.excess(DISTLIB, self.reference) * 1e6) if has_ref else None
            out.append(entry)
        return out


def write_plot(path: str, bench: CollectivesReport) -> None:
    """busbw against size, one line per op and implementation (torch dashed, mpi4py dotted, distlib's
    gloo beside its mpi backend dash-dotted), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, op in enumerate(bench.args.ops):
        points = [p for p in bench.points if p.op == op]
        for impl, style in ((DISTLIB, "-"), (TORCH, "--"), (MPI4PY, ":"), (DISTLIB_GLOO, "-.")):
            if impl not in bench.impls:
                continue
            xs, ys = [], []
            for p in points:
                bw = bench._impl_figures(p, impl)["busbw"]
                if not math.isnan(bw) and bw > 0:
                    xs.append(p.nbytes)
                    ys.append(bw)
            if xs:
                ax.plot(xs, ys, style, marker="o", markersize=3, color=colors[i % len(colors)], label=f"{op} ({impl})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"distlib bench collectives: backend {bench.args.backend}, {bench.n} ranks, {bench.args.dtype}, "
                 f"transport {bench.args.transport}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(args: argparse.Namespace, bench: CollectivesReport, impls: Sequence[str], header: Sequence[str],
           env: Dict[str, Any], wall: float) -> int:
    """Print the header, the tables, the targets and the failures; write the plot and the JSON;
    the exit status (1 for a failure, or a miss under --fail-on-miss)."""
    out = command.text_stream(args.json)
    print("\n".join(header), file=out)
    for text in bench.op_tables():
        print_block(out, text)
    print_block(out, bench.init_table())
    print_block(out, bench.targets_table())
    counts = bench.summary()
    print(file=out)
    ref = SHORT[bench.reference]
    print(f"ratio = how many times better distlib is (busbw distlib/{ref} = time {ref}/distlib)"
          + ("; overhead = distlib's time - raw mpi4py's (the floor)" if args.backend == "mpi" else "") + ". "
          f"targets: {counts[PASS]} PASS, {counts[MISS]} MISS"
          + (f", {counts[NOT_MEASURED]} not measured" if counts[NOT_MEASURED] else ""), file=out)
    for failure in bench.failures:
        print(f"FAILED: {failure}", file=out)
    out.flush()

    plot_error = None
    if args.plot:
        try:
            write_plot(args.plot, bench)
            print(f"plot: {args.plot}", file=out)
        except ImportError as exc:
            plot_error = f"--plot needs matplotlib, which could not be imported ({exc})"
        except OSError as exc:
            plot_error = f"--plot {args.plot}: {exc}"
        if plot_error:
            print(f"distlib bench collectives: {plot_error}", file=sys.stderr)

    if args.json:
        all_rows = [p.row for p in bench.points] + bench.init_rows
        all_rows += [r for _, r in bench.targets if all(r is not x for x in all_rows)]
        command.write_json(args.json, {
            "benchmark": "distlib bench collectives",
            "schema": 1,
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "backend": args.backend,
            "implementations": impls,
            "reference": bench.reference,
            "nproc": args.nproc,
            "collectives": bench.collectives_json(),
            "rows": [row.to_json(impls, bench.reference) for row in all_rows],
            "targets": [dict(row.to_json(impls, bench.reference), label=label) for label, row in bench.targets],
            "summary": counts,
            "failures": bench.failures,
            "wall_seconds": round(wall, 3),
        })
    if bench.failures or plot_error:
        return 1
    if args.fail_on_miss and counts[MISS]:
        return 1
    return 0
