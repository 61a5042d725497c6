"""TCPStore: the c10d TCP store protocol, client and server (byte compatible with torch 2.x)."""

from .client import TCPStore
from .reconnecting import StoreStateLost
from .server import StoreServer

__all__ = ["TCPStore", "StoreServer", "StoreStateLost"]
