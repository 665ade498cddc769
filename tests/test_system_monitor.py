"""The system panel's GPU readings, parsed from what `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` prints."""

import pytest

from rlplatform.infra.system_monitor import parse_nvidia_smi


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


def test_a_failing_measurement_never_ends_the_run(caplog):
    # No Ray at all: listing the nodes, probing them and the object store all fail, every time.
    from rlplatform.infra.system_monitor import SystemMonitor

    monitor = SystemMonitor(interval_s=0.05)
    try:
        assert monitor.sample() == {}
        import time

        time.sleep(0.3)  # several more failing measurements
        assert monitor.sample() == {}
    finally:
        monitor.stop()
    failures = [r for r in caplog.records if "system monitor:" in r.getMessage()]
    kinds = [r.getMessage().split(":")[1] for r in failures]
    assert failures and len(kinds) == len(set(kinds)), kinds  # each kind of failure logged once


@pytest.mark.slow
def test_the_object_store_figure_is_dropped_alone_when_its_reading_fails(monkeypatch):
    import ray

    from rlplatform.config.sizing import Resources
    from rlplatform.infra import local_ray
    from rlplatform.infra.system_monitor import SystemMonitor
    from rlplatform.internals import ray_stats

    local_ray.connect(None, Resources(2, 0, [{"CPU": 2, "GPU": 0}]))
    try:
        monitor = SystemMonitor(interval_s=0.2)
        try:
            figures = monitor.sample()
            assert "ray/object_store_used_gb" in figures  # ray_stats' internal reading works on this Ray
            assert any(k.endswith("/cpu_percent") for k in figures), figures
            import time

            import numpy as np

            block = ray.put(np.ones(4 * 2**20, dtype=np.uint8))  # 4 MiB: stored in the object store, not inlined
            time.sleep(0.6)
            created = monitor.sample()["ray/object_store_created_gb"] - figures["ray/object_store_created_gb"]
            assert created * 1024**3 >= 4 * 2**20, created  # the traffic counter counts what was put
            del block

            def broken(nodes):
                raise RuntimeError("node_stats changed")

            monkeypatch.setattr(ray_stats, "object_store_bytes", broken)
            time.sleep(0.6)
            figures = monitor.sample()
            assert "ray/object_store_used_gb" not in figures and "ray/object_store_created_gb" not in figures
            assert any(k.endswith("/cpu_percent") for k in figures), figures
        finally:
            monitor.stop()
        without = SystemMonitor(interval_s=0.2, object_store=False)  # the speed-up switch off: no internal reading
        try:
            assert "ray/object_store_used_gb" not in without.sample()
        finally:
            without.stop()
    finally:
        ray.shutdown()
