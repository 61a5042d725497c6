"""Stores: where ranks meet. Same classes and API as torch.distributed's stores."""

from .base import DEFAULT_STORE_TIMEOUT, Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp import StoreStateLost, TCPStore

__all__ = ["Store", "HashStore", "PrefixStore", "FileStore", "TCPStore", "StoreStateLost", "DEFAULT_STORE_TIMEOUT"]
