"""The wheel a user installs is the library alone: built from this tree, it carries no module of
the deployment or the benchmarks, installing it brings no docker SDK, and init_process_group
plus a collective work from it (issue 35: "the library apart from its deployment")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TWO_RANKS = textwrap.dedent("""
    import multiprocessing as mp, sys
    from datetime import timedelta
    import numpy as np

    def rank(r, path, out):
        import distlib as dist
        dist.init_process_group("gloo", init_method="file://" + path, rank=r, world_size=2,
                                timeout=timedelta(seconds=60))
        x = np.full(4, r + 1, dtype=np.float32)
        dist.all_reduce(x)
        dist.destroy_process_group()
        out.put((r, x.tolist()))

    if __name__ == "__main__":
        out = mp.Queue()
        procs = [mp.Process(target=rank, args=(r, sys.argv[1], out)) for r in range(2)]
        for p in procs: p.start()
        results = dict(out.get(timeout=90) for _ in procs)
        for p in procs: p.join(30)
        print(sorted(results.items()))
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("distlib_c10d-*.whl")
    return found


def test_the_wheel_carries_the_library_alone(wheel):
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
        modules = [n for n in z.namelist() if n.endswith(".py")]
    assert {t for t in tops if not t.endswith(".dist-info")} == {"distlib"}
    assert not [m for m in modules if "/tools/" in m or "/bench" in m or "/jobs/" in m or "/cluster/" in m], modules


def test_installed_alone_it_brings_no_docker_sdk_and_runs_a_collective(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            timeout=120).stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "docker" not in names and "distlib-c10d" in names, listed
    missing = subprocess.run([str(python), "-c", "import distlib_deploy"], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
    assert missing.returncode != 0 and "ModuleNotFoundError" in missing.stderr
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    ran = subprocess.run([str(python), str(script), str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip() == "[(0, [3.0, 3.0, 3.0, 3.0]), (1, [3.0, 3.0, 3.0, 3.0])]", ran.stdout
    bench = subprocess.run([str(env_dir / "bin" / "distlib"), "bench", "store"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)
    assert bench.returncode == 2 and "distlib-c10d-bench" in bench.stderr, bench.stderr
