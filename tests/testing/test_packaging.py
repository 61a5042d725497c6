"""distlib.testing is apart: `import distlib` never loads it, and it loads the docker SDK only
when the container substrate is used; the plugin is found by its entry point."""

import subprocess
import sys
from importlib.metadata import entry_points


def _loaded_after(statement: str) -> set:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_import_distlib_loads_neither_the_harness_nor_docker_nor_pytest():
    loaded = _loaded_after("import distlib")
    assert not {m for m in loaded if m.startswith("distlib.testing")}, sorted(loaded)
    assert "docker" not in loaded and "pytest" not in loaded


def test_the_harness_loads_docker_only_for_containers():
    loaded = _loaded_after("import distlib.testing, distlib.testing.plugin, distlib.testing.processes")
    assert "docker" not in loaded, sorted(m for m in loaded if m.startswith("docker"))


def test_the_plugin_is_registered_by_entry_point():
    found = [e for e in entry_points(group="pytest11") if e.name == "distlib_testing"]
    assert [e.value for e in found] == ["distlib.testing.plugin"]
