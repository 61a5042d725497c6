"""A third-party backend registered without its devices is warned about at the user's line, not
inside distlib: the warning's file is the caller's."""

import warnings

import distlib as dist
from distlib.backends.registry import Backend


def test_register_backend_without_devices_warns_at_the_callers_line(monkeypatch):
    # register_backend changes class-level tables: each is restored after the test
    monkeypatch.setattr(Backend, "backend_list", list(Backend.backend_list))
    monkeypatch.setattr(Backend, "default_device_backend_map", dict(Backend.default_device_backend_map))
    monkeypatch.setattr(Backend, "_plugins", dict(Backend._plugins))
    monkeypatch.setattr(Backend, "backend_capability", dict(Backend.backend_capability))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.Backend.register_backend("warnedbackend", lambda store, rank, size, timeout: None)
    finally:
        if "WARNEDBACKEND" in vars(Backend):
            delattr(Backend, "WARNEDBACKEND")
    texts = [(str(w.message), w.filename) for w in caught]
    assert [f for t, f in texts if "Device capability of warnedbackend" in t] == [__file__], texts
