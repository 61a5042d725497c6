"""distlib: torch.distributed's process-group layer on numpy and cupy arrays.

Names, arguments and errors follow torch.distributed, so code written against it reads the
same: ``import distlib as dist``.
"""

from .errors import DistBackendError, DistError, DistNetworkError, DistStoreError, QueueEmptyError
from .store import HashStore, PrefixStore, Store

__version__ = "0.1.0"
