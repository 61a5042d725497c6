"""``distlib bench store`` without torch: the command runs, its table and JSON have every
load, and its load generators do what they claim (the barrier ranks really pass a barrier,
the storm's clients really connect). Numbers are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest

from distlib_bench import store as bench
from distlib_bench import store_children, store_measure
from distlib_bench.results import DISTLIB, TORCH
from distlib_bench.store_children import bench_key, storm_child
from distlib_bench.store_measure import SINGLE_OPS, StoreBench
from distlib_bench.store_measure import SECTIONS as BENCH_SECTIONS
from distlib.store.tcp import StoreServer, TCPStore

SECTIONS = {"single client", "concurrent clients", "barrier", "connect storm", "FileStore"}


def run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The command, in its own process (it forks its children from a clean parent)."""
    return subprocess.run([sys.executable, "-m", "distlib.cli", "bench", "store", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_quick_run_prints_every_load_and_writes_json(tmp_path):
    out = tmp_path / "store.json"
    result = run_bench("--quick", "--no-torch", "--json", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for section in SECTIONS:
        assert f"[{section}]" in text
    for load in ("set (fire-and-forget)", "get", "add", "check", "compare_set", "wait (key exists)",
                 "multi_get (8 keys)", "64 ranks", "32 clients connect at once", "replays 1,000 entries"):
        assert load in text, load
    assert "torch not measured: --no-torch" in text
    assert "n/a (no torch)" in text  # relative targets cannot be judged without torch

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "distlib bench store" and doc["implementations"] == ["distlib"]
    assert {row["section"] for row in doc["rows"]} == SECTIONS
    for row in doc["rows"]:
        assert row["distlib"]["median"] > 0, row
        assert row["distlib"]["rounds"], row
        assert "torch" not in row
    assert doc["failures"] == [] and doc["environment"]["torch"] is None
    assert doc["environment"]["client_transports"] == {"distlib": "unix"}
    storm = [row for row in doc["rows"] if row["section"] == "connect storm"][0]
    assert doc["connect_storm"]["distlib"][0]["failed"] == 0
    assert storm["unit"] == "s" and storm["higher_is_better"] is False


def test_json_to_stdout_puts_the_table_on_stderr_and_tcp_transport():
    result = run_bench("--quick", "--no-torch", "--sections", "single", "--distlib-transport", "tcp",
                       "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [row["section"] for row in doc["rows"]] == ["single client"] * len(SINGLE_OPS)
    assert doc["environment"]["client_transports"] == {"distlib": "tcp"}
    assert "[single client]" in result.stderr and "distlib clients over TCP" in result.stderr


def test_bad_options_are_refused():
    assert run_bench("--sections", "nonsense").returncode == 2
    assert run_bench("--clients", "0").returncode == 2


def test_barrier_ranks_pass_a_real_barrier():
    """W raw-protocol ranks: each ADDs, the one that reads W sets done, all WAIT; every
    iteration uses fresh keys and leaves the counter at exactly W."""
    server = StoreServer("127.0.0.1", 0).start()
    world = 40
    ranks = store_children.BarrierRanks("127.0.0.1", server.port, world, 2, "test")
    try:
        ranks.wait_ready(60)
        times = ranks.run(3)
        assert len(times) == 3 and all(t > 0 for t in times)
        # each round splits into arrival (first ADD to SET) and release (SET to last through)
        assert len(ranks.phases) == 3
        for t, (arrival, release) in zip(times, ranks.phases, strict=True):
            assert arrival > 0 and release > 0
            assert abs(arrival + release - t) < 1e-9
        probe = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
        for it in range(3):
            assert probe.get(f"bench/barrier/{it}/arrive") == str(world).encode()
            assert probe.get(f"bench/barrier/{it}/done") == b"1"
        probe.close()
    finally:
        ranks.stop()
        server.stop()


def test_barrier_alternates_implementations_iteration_by_iteration(monkeypatch):
    """distlib, torch, torch, distlib, ...: each iteration is paired with the other
    implementation's next to it, and the speed-up comes from the pairs (fakes stand in for
    the servers and generators; torch is not needed)."""
    calls = []

    class FakeServer:
        def __init__(self, impl, use_libuv, journal=None):
            self.impl = impl

        def __enter__(self):
            return 1

        def __exit__(self, *exc):
            pass

    class FakeRanks:
        def __init__(self, host, port, world, procs, tag):
            self.tag, self.phases = tag, []

        def wait_ready(self, timeout):
            pass

        def run(self, iterations):
            assert iterations == 1
            calls.append(self.tag)
            drift = 1.0 + ((len(calls) - 1) // 2 % 3)  # the machine's speed changes from pair to pair
            t = 0.1 * drift * (1.25 if self.tag == TORCH else 1.0)
            self.phases = [(t * 0.6, t * 0.4)]
            return [t]

        def stop(self):
            pass

    monkeypatch.setattr(store_measure, "LoadServer", FakeServer)
    monkeypatch.setattr(store_measure, "BarrierRanks", FakeRanks)
    args = bench.build_parser().parse_args(["--rounds", "2", "--barrier-ranks", "8", "--barrier-iterations", "3"])
    args.barrier_procs = 1
    sb = StoreBench(args, [DISTLIB, TORCH], lambda text: None)
    sb.barrier()
    d, t = DISTLIB, TORCH
    assert calls == [d, t, t, d, d, t] * 2
    row = sb.rows[0]
    assert len(row.values[d]) == len(row.values[t]) == 2  # one median per round
    assert [len(x["iterations"]) for x in row.details[d]] == [3, 3]
    paired = sb.barrier_pairs[row.name]
    assert paired.pairs == 6 and paired.median == pytest.approx(1.25)
    assert paired.low == pytest.approx(1.25) and paired.high == pytest.approx(1.25)
    assert any("6 paired iterations" in line and "1.25x" in line for line in sb.barrier_lines())


def test_connect_storm_child_connects_everyone():
    server = StoreServer("127.0.0.1", 0).start()
    try:
        result = storm_child(None, "distlib", "127.0.0.1", server.port, True, 24, 30.0)
    finally:
        server.stop()
    assert result["failed"] == 0 and result["errors"] == []
    assert len(result["durations"]) == 24 and result["all_connected_s"] > 0


@pytest.mark.parametrize("prefix, i, key", [("k", 0, "k000000000000000"), ("c12.", 3, "c12.000000000003")])
def test_keys_are_sixteen_bytes(prefix, i, key):
    assert bench_key(prefix, i) == key and len(key) == 16


def test_the_security_section_measures_every_variant_on_its_transport(tmp_path):
    """distlib against itself, with and without the token and TLS (a certificate made with
    openssl for the run): every figure present for every variant, each client on the
    transport its variant names (the run fails otherwise)."""
    from distlib_bench import store_security

    if store_security.make_certificate(str(tmp_path)) is None:
        pytest.skip("no openssl command to make the bench's certificate")
    result = run_bench("--quick", "--no-torch", "--sections", "security", "--seconds", "0.05",
                       "--security-connects", "5", "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["rows"] == [] and doc["failures"] == []
    names = {variant[0] for variant in store_security.VARIANTS}
    for row in doc["security"]:
        measured = {name for name in names if row[name]["median"]}
        assert measured == names, (row["name"], measured)
    text = result.stderr
    assert "security cost (distlib vs distlib)" in text and "tcp+token+tls" in text and "unix+token" in text
    assert "[single client]" not in text  # not part of the comparison with torch


def test_the_security_section_is_not_run_unless_asked():
    assert "security" in BENCH_SECTIONS and "security" not in bench.build_parser().parse_args([]).sections
