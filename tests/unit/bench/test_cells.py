"""bench/cells.py: the presets (with their real parameter counts), the command line's lists, the memory estimate."""

from __future__ import annotations

import pytest

from deadpool.bench.cells import (
    PROCESS_BYTES,
    SIZES,
    deadpool_memory,
    parameter_counts,
    parse_ranks,
    parse_sizes,
    parse_variants,
)
from deadpool.errors import ConfigError


def test_presets_and_their_real_parameter_counts():
    assert [s.name for s in parse_sizes("50M, 1M")] == ["50M", "1M"]
    counts = parameter_counts(list(SIZES.values()))
    assert counts["3M"] == 3_202_304  # the example's defaults
    for name, nominal in (("1M", 1e6), ("10M", 10e6), ("50M", 50e6)):
        assert 0.9 * nominal < counts[name] < 1.1 * nominal
    assert "--batch-size" in SIZES["50M"].script_args()


def test_memory_estimate_counts_live_state_and_local_slots_which_the_spare_maps():
    # per rank 16 B/parameter live, 2 x 12 B in its slots (the spare on the same machine maps those)
    assert deadpool_memory(1000, ranks=4, spares=1) == 4 * 1000 * (16 + 24) + 5 * PROCESS_BYTES
    assert deadpool_memory(1000, ranks=4, spares=0) == 4 * 1000 * (16 + 24) + 4 * PROCESS_BYTES


def test_lists_are_checked_and_baselines_added():
    assert [v.name for v in parse_variants("dcp-async,deadpool-every-1")] == \
        ["deadpool-off", "deadpool-every-1", "dcp-off", "dcp-async"]
    assert parse_ranks("2,4,2") == [2, 4]
    for bad in (lambda: parse_sizes("7M"), lambda: parse_ranks("0"), lambda: parse_ranks("two"),
                lambda: parse_variants("dcp")):
        with pytest.raises(ConfigError):
            bad()
