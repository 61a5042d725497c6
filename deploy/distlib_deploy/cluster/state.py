"""The record of the last run started from a state directory (``CLUSTER_STATE_DIR``, default
``.build/cluster``): a JSON file, so that `down`, `logs`, `ps` and `report` find the run's
Compose project, files, command and variables without anything being sourced or re-derived.
Each run also gets a directory ``<state dir>/<project>/`` for its logs and its report.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from distlib.command import ToolError

CURRENT = "current.json"


@dataclass
class Run:
    project: str
    run_id: str
    mode: str
    nodes: int
    image: str
    files: List[str]
    compose: List[str]
    variables: Dict[str, str] = field(default_factory=dict)
    job: str = ""
    #: Whether the run's containers got a token (AUTH); its file is <run directory>/auth/token.
    auth: bool = False

    def directory(self, state_dir: Path) -> Path:
        return state_dir / self.project


def load(state_dir: Path) -> Optional[Run]:
    """The recorded run, or None; ToolError when the record is unreadable (it names the file)."""
    path = state_dir / CURRENT
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot read the record of the last run {path}: {exc} (remove it; make cluster-down "
                        "still removes what carries this checkout's labels)") from None
    try:
        return Run(**data)
    except TypeError as exc:
        raise ToolError(f"{path} is not a run record ({exc}); remove it") from None


def save(state_dir: Path, run: Run) -> Path:
    """Record ``run`` (atomically) and create its directory; returns that directory."""
    directory = run.directory(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f"{CURRENT}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(asdict(run), indent=2) + "\n")
    os.replace(tmp, state_dir / CURRENT)
    return directory


def clear(state_dir: Path) -> None:
    try:
        (state_dir / CURRENT).unlink()
    except FileNotFoundError:
        pass
