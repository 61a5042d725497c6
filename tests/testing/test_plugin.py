"""The pytest plugin as a user's repository meets it: no conftest code, only the entry point.

Each test writes a small user project (a job and a test file) and runs pytest on it in a
subprocess, as CI would.
"""

import json
import shutil
from pathlib import Path

import pytest

from distlib.testing import privilege

pytest_plugins = ["pytester"]

JOB = Path(__file__).parent / "jobs" / "steps.py"

KILLED_TEST = '''
from distlib.testing import Job, cues, faults

def test_survivors_name_the_victim(distlib_cluster):
    cluster = distlib_cluster(nodes=3)
    result = cluster.run(Job.script("steps.py", env={"STEPS": "400", "GROUP_TIMEOUT": "20"}),
                         [(cues.Collective(0, 4), faults.KillNode(2))], deadline=120)
    result.assert_survivors_raised("DistBackendError", naming=NAMING, victims=[2])
'''


@pytest.fixture
def project(pytester):
    shutil.copy(JOB, pytester.path / "steps.py")
    return pytester


def test_a_failing_test_saves_its_schedule_and_a_replay_runs_it_again(project):
    if privilege.why_not():
        pytest.skip(privilege.why_not())
    project.makepyfile(test_user=KILLED_TEST.replace("NAMING", repr("rank 7")))  # names the wrong rank: fails
    first = project.runpytest_subprocess("-p", "no:cacheprovider", "--distlib-schedules", "saved")
    first.assert_outcomes(failed=1)
    out = first.stdout.str()
    assert "does not name 'rank\\\\ 7'" in out or "does not name 'rank 7'" in out, out
    saved = list((project.path / "saved").glob("*.json"))
    assert len(saved) == 1, out
    data = json.loads(saved[0].read_text())
    assert data["test"] == "test_user.py::test_survivors_name_the_victim"
    assert data["steps"] == [{"cue": {"cue": "collective", "rank": 0, "n": 4}, "fault": {"fault": "kill_node",
                                                                                       "node": 2}}]
    assert f"--distlib-replay {saved[0].relative_to(project.path)}" in out
    # the replayed schedule replaces the test's own: here, a kill of node 1 instead
    data["steps"][0]["fault"]["node"] = 1
    saved[0].write_text(json.dumps(data))
    project.makepyfile(test_user=KILLED_TEST.replace("NAMING", "1").replace("victims=[2]", "victims=[1]"))
    again = project.runpytest_subprocess("-p", "no:cacheprovider", "--distlib-replay", str(saved[0]))
    again.assert_outcomes(passed=1)


def test_a_fault_this_runner_cannot_make_skips_with_the_reason_or_fails_when_strict(project):
    project.makepyfile(test_user='''
from distlib.testing import Job, cues, faults

def test_delay(distlib_cluster):
    cluster = distlib_cluster(nodes=2, namespaces=False)
    cluster.run(Job.script("steps.py"), [(cues.Collective(0, 1), faults.DegradeLink(1, delay_ms=50))])
''')
    lenient = project.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    lenient.assert_outcomes(skipped=1)
    assert "50 ms delay on node1's link needs network, which the processes substrate has not here" in \
        lenient.stdout.str(), lenient.stdout.str()
    strict = project.runpytest_subprocess("-p", "no:cacheprovider", "--distlib-strict")
    strict.assert_outcomes(failed=1)
    assert "(--distlib-strict)" in strict.stdout.str()


def test_shrinking_keeps_the_one_step_that_makes_the_test_fail(project):
    if privilege.why_not():
        pytest.skip(privilege.why_not())
    project.makepyfile(test_user='''
from distlib.testing import Job, cues, faults

def test_job_succeeds(distlib_cluster):
    cluster = distlib_cluster(nodes=2)
    result = cluster.run(Job.script("steps.py", env={"STEPS": "30", "GROUP_TIMEOUT": "20"}), [
        (cues.Collective(0, 2), faults.Heal()), (cues.Collective(0, 4), faults.Resolvable(1)),
        (cues.Collective(0, 10), faults.KillNode(1)),
        (cues.Collective(0, 12), faults.Heal()),
    ], deadline=30)
    result.assert_ok(world_size=2)
''')
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--distlib-shrink", "--distlib-schedules", "saved")
    run.assert_outcomes(failed=1)
    shrunk = list((project.path / "saved").glob("*.shrunk.json"))
    assert len(shrunk) == 1, run.stdout.str()
    steps = json.loads(shrunk[0].read_text())["steps"]
    assert steps == [{"cue": {"cue": "collective", "rank": 0, "n": 10}, "fault": {"fault": "kill_node", "node": 1}}]
