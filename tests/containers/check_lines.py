"""What deploy/distlib_deploy/jobs/check_collectives.py prints, read back from a rank's record
(the container tests run it on hosts of distlib.testing)."""

from __future__ import annotations

import re
from typing import Dict

from distlib.testing import Job, Result

CHECK = ["-m", "distlib_deploy.jobs.check_collectives"]
OK_LINE = re.compile(r"check_collectives: rank (\d+)/(\d+) OK all_reduce=(\d+) all_gather=([\d,]+) host=(\S+) "
                     r"address=(\S+)")
FAILED_LINE = re.compile(r"check_collectives: rank (\S+) FAILED after ([\d.]+) s: (\w+): (.*)")


def check(*args: str, **env: str) -> Job:
    """check_collectives on every host, with these arguments and environment."""
    return Job(CHECK + [str(a) for a in args], {k: str(v) for k, v in env.items()})


def expected_sum(world: int, n: int = 16) -> int:
    return world * n * (n - 1) // 2 + n * world * (world - 1) // 2


def line(result: Result, host: str, pattern: "re.Pattern[str]") -> "re.Match[str]":
    """The first line of ``host``'s output that matches, or a failure showing its output."""
    for text in result.hosts[host].output:
        m = pattern.search(text)
        if m:
            return m
    raise AssertionError(f"{host} printed no line matching {pattern.pattern!r}:\n{result.hosts[host].tail(30)}")


def assert_all_ok(result: Result, world: int) -> Dict[int, "re.Match[str]"]:
    """Every node exited 0 having printed a correct OK line; the matches by rank."""
    result.assert_no_hang()
    found = {}
    for name, host in result.hosts.items():
        if name == "master":
            continue
        assert host.exit_code == 0, f"{name} exited with {host.exit_code}:\n{host.tail(30)}"
        m = line(result, name, OK_LINE)
        rank = int(m.group(1))
        assert int(m.group(2)) == world and int(m.group(3)) == expected_sum(world), m.group(0)
        assert m.group(4) == ",".join(str(k) for k in range(world)), m.group(0)
        found[rank] = m
    assert sorted(found) == list(range(world)), sorted(found)
    return found
