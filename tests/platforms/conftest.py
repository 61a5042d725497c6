"""Fixtures of the platform tests: real hosts in VMs (tests/support/vm.py) and, on them,
real NFS (tests/support/vm_nfs.py).

    vm_image   (session) the cached VM image (build-vm-image.sh: minutes once, then instant)
    nfs_hosts  (package) the kernel NFS server VM, 3 client VMs and a spare (for the test that
               powers one off), and the Compose cluster's NFS server container (MODE=nfs),
               every mount in every client; all of it removed after the package's last test
               (emulated VMs cost CPU even when idle)

The image needs root (debootstrap) and a Debian host (apt); the ganesha container needs the
Docker engine and the distlib image (the distlib_image fixture). Where they are missing the
tests are skipped, or fail with DISTLIB_REQUIRE_DOCKER=1 (CI), as the container tests do.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.lanes import unavailable

from tests.support import vm as vm_module
from tests.support import vm_nfs


@pytest.fixture(scope="session")
def vm_image() -> vm_module.Image:
    if not os.path.exists("/proc/self/mountinfo") or shutil.which("apt-get") is None:
        unavailable("the VM tests need a Debian Linux host (apt-get) to build their image", "vms")
    if os.geteuid() != 0 and not any(vm_module.CACHE.glob("nfs-vm/image-*/image.env")):
        unavailable("building the VM image needs root (debootstrap) once", "vms")
    try:
        return vm_module.ensure_image("nfs-vm")
    except vm_module.VMError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="package")
def nfs_hosts(vm_image, distlib_image):
    with vm_nfs.start(vm_image, clients=3, spares=1, ganesha_image=distlib_image) as hosts:
        yield hosts
