"""The system panel's GPU readings, parsed from what `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` prints."""

from rlplatform.system_monitor import parse_nvidia_smi


def test_each_gpu_gives_utilisation_and_memory_in_gb():
    assert parse_nvidia_smi("87, 40960\n3, 512\n") == [
        {"util_percent": 87.0, "mem_used_gb": 40.0},
        {"util_percent": 3.0, "mem_used_gb": 0.5},
    ]


def test_a_value_nvidia_smi_cannot_read_is_left_out_not_the_node():
    # A MIG instance reports no utilisation; some boards support neither field.
    assert parse_nvidia_smi("[N/A], 2048\n[Not Supported], [Not Supported]\n") == [{"mem_used_gb": 2.0}, {}]


def test_no_gpu_no_rows():
    assert parse_nvidia_smi("") == []
