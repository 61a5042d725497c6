"""Which GPU a rank's communicator uses: device_id, the array's device, LOCAL_RANK, current."""

import pytest

from distlib.backends.nccl.devices import (
    check_same_device,
    choose_device,
    local_rank,
    parse_device_id,
    shared_gpus_hint,
)
from distlib.identity import Identity


class _Device:
    """What cupy.cuda.Device exposes to parse_device_id: an integer id."""

    def __init__(self, id):  # noqa: A002 - cupy's attribute name
        self.id = id


@pytest.mark.parametrize("given, index", [(None, None), ("cpu", None), (3, 3), ("cuda:2", 2), (" CUDA:0 ", 0),
                                          (_Device(1), 1)])
def test_device_id_forms(given, index):
    assert parse_device_id(given) == index


@pytest.mark.parametrize("given, error, text", [
    ("cuda", ValueError, "Please use a device_id with index."),
    ("xpu:0", ValueError, "does not match the accelerator"),
    ("cuda:x", ValueError, "must be a non-negative int"),
    (-1, ValueError, "must not be negative"),
    (True, TypeError, "must be an int"),
    (2.0, TypeError, "must be an int, 'cuda:N'"),
])
def test_bad_device_ids(given, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_device_id(given)


def test_device_id_out_of_range_in_torchs_words():
    with pytest.raises(ValueError, match=r"device_id cuda:4 is out of range\. Please use a device index less than "
                                         r"the number of accelerators available: 4\."):
        parse_device_id(4, device_count=4)
    assert parse_device_id(3, device_count=4) == 3


def test_bound_device_wins_and_other_arrays_are_refused():
    assert choose_device(None, 2, Identity(local_rank=1), 0, 4) == (2, "device_id=2")
    assert choose_device(2, 2, Identity(), 0, 4)[0] == 2
    with pytest.raises(ValueError, match=r"the array is on cuda:1, but the process group is bound to cuda:2"):
        choose_device(1, 2, Identity(), 0, 4)


def test_the_arrays_device_comes_before_local_rank():
    assert choose_device(3, None, Identity(local_rank=1), 0, 4) == (3, "the array's device")


def test_local_rank_picks_the_default_device_modulo_the_visible_ones():
    assert choose_device(None, None, Identity(local_rank=1), 0, 4) == (1, "LOCAL_RANK=1 of 4 visible device(s)")
    assert choose_device(None, None, Identity(local_rank=5), 0, 4)[0] == 1
    assert choose_device(None, None, Identity.read({"LOCAL_RANK": " "}), 2, 4) == (2, "the current cupy device")
    assert choose_device(None, None, Identity(), 2, 4) == (2, "the current cupy device")


def test_a_malformed_local_rank_is_an_error_naming_it():
    assert local_rank(Identity.read({"LOCAL_RANK": "7"})) == 7 and local_rank(Identity.read({})) is None
    with pytest.raises(ValueError, match="LOCAL_RANK='one' is not an integer"):
        choose_device(None, None, Identity.read({"LOCAL_RANK": "one"}), 0, 2)


def test_an_array_on_another_gpu_than_the_communicator():
    check_same_device(1, 1, "tensor", "pg0/nccl")
    with pytest.raises(ValueError, match=r"tensor is on cuda:0, but pg0/nccl's NCCL communicator is on cuda:1"):
        check_same_device(0, 1, "tensor", "pg0/nccl")


def test_the_hint_for_ranks_sharing_a_gpu():
    records = [{"hostname": "a", "device": 0}, {"hostname": "a", "device": 1}, {"hostname": "b", "device": 0}]
    assert shared_gpus_hint(records) == ""
    records.append({"hostname": "a", "device": 0})
    hint = shared_gpus_hint(records)
    assert "Ranks 0, 3 all use cuda:0 on a" in hint and "Duplicate GPU detected" in hint
    assert "NCCL_HOSTID" in hint and "NCCL_MULTI_RANK_GPU_ENABLE=1" in hint
