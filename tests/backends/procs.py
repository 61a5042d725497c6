"""One real process per call, each with its own environment (ranks that differ in RANK, in
their token, or in when they start): ``Proc(fn, *args, env=...)`` runs ``fn(*args)`` in a
fresh interpreter (spawn) and ``result()`` gives ``("ok", value)`` or ``("error", text)``."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

_CTX = mp.get_context("spawn")


def _main(fn: Callable, args: tuple, env: Dict[str, str], out) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        out.put(("ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Proc:
    def __init__(self, fn: Callable, *args, env: Optional[Dict[str, Optional[str]]] = None):
        self._out = _CTX.Queue()
        self.process = _CTX.Process(target=_main, args=(fn, args, env or {}, self._out), daemon=True)
        self.process.start()

    def result(self, timeout: float) -> Tuple[str, Any]:
        """What ``fn`` returned or raised, waiting at most ``timeout`` seconds (then the process
        is killed and the result says so)."""
        try:
            value = self._out.get(timeout=timeout)
        except queue_module.Empty:
            value = ("error", f"no result within {timeout:.0f}s (exit code {self.process.exitcode})")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return value
