"""What the test lanes stand on, kept out of the test modules so that no test module imports
another (tests/test_test_tree.py holds that):

    settings.py        the suite's DISTLIB_* switches
    lanes.py           the lanes, one marker each, and the check that holds each test to its own
    compose.py         the Compose cluster driven from a test (its implementations, `run_cluster`)
    cluster_token.py   what every cluster run must show about its token
    image_contents.py  what the distlib images must hold, read from the working tree
    import_graph.py    the packages' import graph, for the layering tests
    kube.py            a real Kubernetes 1.20 control plane and kubelet on 127.0.0.1
    kube_stand_ins.py  what 1.20 lacks here: the Indexed Job controller and cluster DNS
    vm.py              Linux VMs under QEMU, their LAN and their cleanup
    vm_kernel.py       the bzImage → vmlinux step of the VM image's build
    vm_nfs.py          real NFS hosts in those VMs (kernel server, nfs-ganesha, the clients)
    slurm.py           a Slurm 22.05 cluster in containers (fixtures)
"""
