"""``distlib bench collectives --device cuda``, the parts a machine without a GPU can check: the
one-line refusal, the options and their cuda defaults, the sweep always holding the targets'
sizes, the targets (targets.json) judged on rows, the table's target column, where each rank
runs, and the device copies around each case (with host arrays standing in for the GPU's). The
run itself: tests/gpu/test_bench_cuda_gpu.py (skips without a device). Timings are never asserted."""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest

from distlib_bench import collectives as cpu
from distlib_bench import collectives_cli
from distlib_bench.cases import Case
from distlib_bench import collectives_cuda as cuda
from distlib_bench.results import MISS, NOT_MEASURED, PASS
from distlib_bench.tables import Printer

MIB = 1 << 20


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlib_bench", "collectives", *args], capture_output=True,
                          text=True, timeout=120)


def parse(*argv: str) -> argparse.Namespace:
    parser = cpu.build_parser()
    if collectives_cli._device(list(argv)) == "cuda":
        cuda.set_defaults(parser)
    return parser.parse_args(list(argv))


def test_without_a_device_it_says_so_in_one_line():
    from distlib.backends import cupy_env

    if cupy_env.status().usable:
        pytest.skip("a CUDA device is here")
    done = run_bench("--device", "cuda", "--no-torch")
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("distlib bench collectives: --device cuda needs a CUDA device: ")
    assert cupy_env.status().problem.split(" (")[0] in lines[0] or "no CUDA device visible" in lines[0]


@pytest.mark.parametrize("args, words", [
    (["--backend", "nccl"], "--backend nccl runs on GPUs: add --device cuda"),
    (["--device", "cuda", "--nproc", "0"], "--nproc 0: 1 to 64 ranks"),
    (["--device", "cuda", "--transport", "tcp"], "--transport is about distlib's CPU shared memory"),
    (["--device", "cuda", "--init-sizes", "8"], "--init-sizes measures gloo's init on the CPU"),
    (["--device", "cuda", "-b", "1M", "-e", "4K"], "--min-bytes (1048576) is larger than --max-bytes (4096)"),
])
def test_options_that_make_no_sense_on_gpus_are_refused(args, words):
    done = run_bench(*args)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_cuda_defaults_and_given_options_win():
    args = parse("--device", "cuda")
    assert (args.min_bytes, args.max_bytes, args.step_factor, args.init_sizes) == (8, 256 * MIB, 4, [])
    assert args.backend is None and args.nproc == 2
    args = parse("--device=cuda", "-b", "4", "-e", "1M", "--backend", "gloo", "--nproc", "1")
    assert (args.min_bytes, args.max_bytes, args.backend, args.nproc) == (4, MIB, "gloo", 1)
    # the CPU run keeps its own (--init-sizes: decided by the backend when the run starts)
    args = parse()
    assert (args.min_bytes, args.max_bytes, args.init_sizes, args.device) == (4, 64 * MIB, None, "cpu")


def bench_for(*argv: str, impls=("distlib", "torch")) -> cuda.CudaCollectivesBench:
    return cuda.CudaCollectivesBench(parse("--device", "cuda", *argv), list(impls), Printer(quiet=True), devices=1)


def test_the_sweep_holds_the_target_sizes():
    bench = bench_for("--ops", "all_reduce,broadcast")
    bench._plan()
    sizes = [p.nbytes for p in bench.points if p.op == "all_reduce"]
    assert sizes[0] == 8 and sizes[-1] == 256 * MIB and sizes == sorted(sizes)
    assert 256 * MIB not in [8 * 4 ** k for k in range(14)]  # not on the x4 sweep by itself
    assert [p.op for p in bench.points] == sorted((p.op for p in bench.points), key=["all_reduce", "broadcast"].index)
    assert 256 * MIB not in [p.nbytes for p in bench.points if p.op == "broadcast"]


def _judged(nproc: int, distlib_s: dict, torch_s: dict, *argv: str):
    bench = bench_for("--ops", "all_reduce", "--nproc", str(nproc), *argv)
    bench._plan()
    bench._add_targets()
    for point in bench.points:
        if point.nbytes in distlib_s:
            point.row.add("distlib", distlib_s[point.nbytes])
            point.row.add("torch", torch_s[point.nbytes])
    return bench


def test_targets_from_targets_json_judge_the_rows():
    big, small = 256 * MIB, 8
    bench = _judged(2, {big: 0.1 / 0.96, small: 12e-6}, {big: 0.1, small: 10e-6})
    results = {label: row.result() for label, row in bench.targets}
    assert results == {"nccl all_reduce 256 MiB busbw, 2 rank(s)": PASS,   # 0.96x >= 0.95x
                       "nccl all_reduce 8 B latency, 2 rank(s)": PASS,     # 1.2x the time, just
                       "nccl 8 B all_reduce, 10,000 in flight vs 10, 2 rank(s)": NOT_MEASURED}
    bench = _judged(2, {big: 0.1 / 0.94, small: 12.1e-6}, {big: 0.1, small: 10e-6})
    assert {row.result() for _, row in bench.targets} == {MISS, NOT_MEASURED}
    table = bench.targets_table()
    assert ">= 0.95x torch nccl (busbw)" in table and "<= 1.2x torch nccl's time" in table
    assert "2.5 GB/s" in table  # busbw = 256 MiB / 0.1064 s x 2(n-1)/n


def test_one_rank_shows_algbw_and_judges_by_time():
    big = 256 * MIB
    bench = _judged(1, {big: 1e-3}, {big: 1e-3})
    (label, row), *_ = bench.targets
    assert label == "nccl all_reduce 256 MiB busbw, 1 rank(s)" and row.result() == PASS
    assert bench._value_text(row, "distlib") == "algbw 268.4 GB/s"  # busbw is 0 at one rank


def test_the_per_call_rows_and_their_targets():
    """At one rank: 8 B back to back against torch (<= 0.5x its time), and 10,000 in flight
    against distlib's own 10 (<= 1.2x); the table says whether the stream was held to the end."""
    bench = _judged(1, {}, {})
    rows = {(calls, flight): row for calls, flight, row in bench.per_call_rows}
    assert sorted(rows) == [(10, True), (3000, False), (10000, True)]
    rows[(3000, False)].add("distlib", 10e-6)
    rows[(3000, False)].add("torch", 26e-6)
    rows[(10, True)].add("distlib", 12e-6, held=[True])
    rows[(10000, True)].add("distlib", 14.3e-6, held=[True])
    rows[(10000, True)].add("torch", 30e-6, held=[False])
    results = {label: row.result() for label, row in bench.targets}
    assert results["nccl 8 B all_reduce, 3000 back to back, 1 rank(s)"] == PASS  # 2.6x faster
    assert results["nccl 8 B all_reduce, 10,000 in flight vs 10, 1 rank(s)"] == PASS  # 14.3 / 12 = 1.19x
    rows[(10000, True)].values["distlib"] = [14.6e-6]  # 1.22x the time at 10
    assert dict(bench.targets)["nccl 8 B all_reduce, 10,000 in flight vs 10, 1 rank(s)"].result() == MISS
    table = bench._per_call_table()
    assert "3000 back to back" in table and "10,000 in flight" in table and "NO: the spin ended first" in table
    entries = [e for e in bench.collectives_json() if e.get("calls")]
    assert [(e["calls"], e["in_flight"], e["distlib"]["validated"]) for e in entries] == \
        [(3000, False, True), (10, True, True), (10000, True, True)]
    assert _judged(1, {}, {}, "--backend", "gloo").per_call_rows == []


def test_targets_missing_from_the_run_say_why_and_gloo_has_none():
    bench = _judged(2, {}, {}, "-e", "1M")
    rows = dict(bench.targets)
    assert rows["nccl all_reduce 256 MiB busbw, 2 rank(s)"].note == "not in this run (needs 256 MiB all_reduce of float32)"
    assert rows["nccl all_reduce 256 MiB busbw, 2 rank(s)"].result() == NOT_MEASURED
    assert _judged(4, {}, {}).targets == []  # the targets are for 1 and 2 ranks
    assert _judged(2, {}, {}, "--backend", "gloo").targets == []


def test_where_each_rank_runs():
    assert cuda.placement(0, 1, 1, "nccl") == (0, {})
    assert cuda.placement(1, 2, 1, "nccl") == (0, {"NCCL_HOSTID": "distlib-bench-rank1", "NCCL_SOCKET_IFNAME": "lo",
                                                    "NCCL_IB_DISABLE": "1"})
    assert cuda.placement(3, 4, 2, "nccl")[0] == 1 and cuda.placement(1, 2, 2, "nccl") == (1, {})
    assert cuda.placement(1, 2, 1, "gloo") == (0, {})  # gloo does not care who shares a GPU


class HostDevice:
    """Host arrays standing in for a GPU's, with the copies counted."""

    def __init__(self):
        self.uploads = self.downloads = self.syncs = 0

    def upload_new(self, host):
        return host.copy()

    def upload(self, host, dev):
        self.uploads += 1
        dev[...] = host

    def download(self, dev, host):
        self.downloads += 1
        host[...] = dev

    def zero(self, dev):
        dev[...] = 0

    def synchronize(self):
        self.syncs += 1


@pytest.mark.parametrize("op", ["all_reduce", "all_gather_into_tensor"])
def test_a_case_runs_on_the_device_copies_and_is_checked_on_the_host(op):
    device = HostDevice()
    case = cuda._DeviceCase(Case(op, 8, "float32", 0, 1), device)
    assert all(host is not dev for host, dev in case.pairs)
    calls = []

    class Dist:  # a one-rank group: every op leaves the data as it is, as a one-rank NCCL does
        def all_reduce(self, array):
            calls.append(array)

        def all_gather_into_tensor(self, out, inp):
            calls.append(out)
            out[...] = inp

    call = case.bind(Dist())
    case.fill()
    assert device.uploads == len(case.pairs)
    call()
    assert calls and all(any(c is dev for _, dev in case.pairs) for c in calls)  # the device buffers
    assert case.check() is None and device.syncs == 1 and device.downloads == len(case.pairs)
    for _, dev in case.pairs:
        dev[...] = 7  # a wrong result on the device is seen
    assert case.check() is not None
    case.zero()
    assert all(not np.any(dev) for _, dev in case.pairs)


def test_the_header_names_both_libraries_and_the_placement():
    args = parse("--device", "cuda")
    facts = {"cupy": "14.2.0", "nccl": "2.32.3", "torch_nccl": "2.29.7", "count": 1, "driver": "12.8",
             "cuda_runtime": "12.9", "devices": ["cuda:0 NVIDIA H100 80GB HBM3, compute capability 9.0"]}
    lines = cuda.header(args, facts, ["distlib", "torch"], "2.13.0", "", {"distlib": "0.1.0"}, 12.0)
    assert lines[0] == ("distlib bench collectives --device cuda: distlib 0.1.0 nccl on cupy 14.2.0 (NCCL 2.32.3) vs "
                        "torch 2.13.0 nccl on CUDA tensors (NCCL 2.29.7)")
    assert "2 ranks on 1 GPU(s), sharing them: each rank its own NCCL_HOSTID" in lines[1]
    assert "synchronises the device" in lines[2]
