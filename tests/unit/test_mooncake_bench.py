"""The Mooncake Store baseline runs for real when mooncake is installed."""

from __future__ import annotations

import pytest

from kvpool_bench.mooncake import (
    mooncake_available,
    mooncake_rounds,
    run_mooncake_local,
    run_mooncake_remote,
    size_label,
)

needs_mooncake = pytest.mark.skipif(
    not mooncake_available(),
    reason="mooncake not installed (pip install mooncake-transfer-engine-non-cuda; "
    "apt-get install libibverbs1)",
)


def test_size_label() -> None:
    assert size_label(1 << 20) == "1MiB"
    assert size_label(4 << 20) == "4MiB"
    assert size_label(1 << 30) == "1GiB"
    assert size_label(1536 << 10) == "1536KiB"
    assert size_label(1000) == "1000B"


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run_mooncake_local([], batch=4, rounds=2)
    with pytest.raises(ValueError):
        run_mooncake_local([1 << 20], batch=0, rounds=2)


@pytest.mark.slow
@needs_mooncake
def test_run_mooncake_local_measures_put_and_get() -> None:
    result = run_mooncake_local([1 << 20], batch=4, rounds=2)

    assert set(result) == {"1MiB"}
    assert set(result["1MiB"]) == {"put_gbps", "get_gbps"}
    assert result["1MiB"]["put_gbps"] > 0
    assert result["1MiB"]["get_gbps"] > 0


@pytest.mark.slow
@needs_mooncake
def test_run_mooncake_remote_reads_across_processes() -> None:
    result = run_mooncake_remote([1 << 20], batch=4, rounds=2)

    assert result["1MiB"]["get_gbps"] > 0
    assert result["1MiB"]["put_gbps"] > 0


@pytest.mark.slow
@needs_mooncake
def test_mooncake_rounds_run_one_round_at_a_time_and_check_the_bytes_read_back() -> None:
    """What ``kvpool bench local`` pairs with each of its own rounds."""
    with mooncake_rounds([1 << 20, 64 << 10], batch=4) as mc:
        times = [mc.round(1 << 20, check=True), mc.round(64 << 10, check=True), mc.round(1 << 20)]
    assert len(times) == 3 and all(put > 0 and get > 0 for put, get in times)
    with pytest.raises(ValueError):
        with mooncake_rounds([], batch=4):
            pass
