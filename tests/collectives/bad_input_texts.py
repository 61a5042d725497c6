"""The words each bad-input error must contain (cases.bad_input_errors makes the errors): one
table for every backend that runs the case (gloo here, mpi in tests/mpi)."""

EXPECTED_TEXT = {
    "non_contiguous": "not contiguous",
    "object_dtype": "dtype object",
    "not_array": "numpy array",
    "bitwise_on_float": "bitwise",
    "avg_on_int": "floating-point",
    "min_on_complex": "complex",
    "list_length": "one per rank",
    "list_dtype": "dtype",
    "rank_out_of_range": "not part of group",
    "output_size": "world_size x input",
    "read_only": "read-only",
    "send_to_self": "self",
    "splits": "entries",
}
