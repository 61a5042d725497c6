"""``StoreSecurity``: what a store connection must go through — the token, TLS — in one value.

Why one value: the server (rank 0's, ``distlib store-server``, the launcher's) and every
client take their settings from the same place, the environment (``DISTLIB_AUTH_TOKEN`` /
``DISTLIB_AUTH_TOKEN_FILE``, ``DISTLIB_TLS_CERT`` / ``DISTLIB_TLS_KEY`` / ``DISTLIB_TLS_CA``,
read through distlib/settings.py), or from the command line of ``distlib store-server``. A
server built without an explicit value reads the environment: a process that has the token
never starts a store that does not ask for it.

TLS contexts are built when first needed: a client never loads the server's key, and a
server never needs the CA.
"""

from __future__ import annotations

import ssl
from typing import Mapping, Optional

from ... import settings, tls
from ...auth import configured_token


class StoreSecurity:
    """The token (or None) and the TLS files (or ""), with their contexts built on demand.

    ``token``: every connection must pass the challenge-response of distlib/auth.py.
    ``cert``/``key``: a server speaks TLS on TCP with them. ``ca``: a client speaks TLS and
    verifies the server with it. The same-host UNIX socket never uses TLS (docs/security.md).
    """

    __slots__ = ("token", "cert", "key", "ca", "_server_tls", "_client_tls", "_sources")

    def __init__(self, token: Optional[bytes] = None, cert: str = "", key: str = "", ca: str = "",
                 sources: Optional[Mapping[str, str]] = None):
        self.token = token or None
        self.cert, self.key, self.ca = cert, key, ca
        self._server_tls: Optional[ssl.SSLContext] = None
        self._client_tls: Optional[ssl.SSLContext] = None
        #: How each file was given ("DISTLIB_TLS_CERT" or "--tls-cert"), for error texts.
        self._sources = dict(sources or {})

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "StoreSecurity":
        """The job's settings. ValueError for a token or a file setting that cannot be right."""
        cert, key, ca = settings.tls_files(env)
        return cls(configured_token(env), cert, key, ca)

    @property
    def server_tls(self) -> Optional[ssl.SSLContext]:
        """The server's TLS context, or None without a certificate and key."""
        if self._server_tls is None and (self.cert or self.key):
            self._server_tls = tls.server_context(self.cert, self.key, self.source("cert"), self.source("key"))
        return self._server_tls

    @property
    def client_tls(self) -> Optional[ssl.SSLContext]:
        """A client's TLS context, or None without a CA."""
        if self._client_tls is None and self.ca:
            self._client_tls = tls.client_context(self.ca, self.source("ca"))
        return self._client_tls

    def source(self, name: str) -> str:
        """How the file ``name`` ("cert", "key", "ca") was given: its variable or its flag."""
        return self._sources.get(name, f"DISTLIB_TLS_{name.upper()}")

    def describe_server(self) -> str:
        """For the server's start-up log line."""
        return (f"authentication: {'token required' if self.token else 'none (DISTLIB_AUTH_TOKEN not set)'}; "
                f"TLS: {'on (' + self.cert + ')' if self.cert else 'off'}")
