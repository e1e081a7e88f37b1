"""``ChunkIndex`` and the chunk plans' arguments: the shared checks of ``_validate``."""

from __future__ import annotations

import pytest

from promptsplice.engine_adapters import BlockStore, ChunkIndex, StoreConfig
from promptsplice.engine_adapters.connector._scheduler import SpliceScheduler
from promptsplice.errors import ConfigError


@pytest.mark.parametrize("bad", [0, -32, True, 10**9, "32", 32.0])
def test_a_block_size_no_engine_has_is_refused_by_the_shared_rule(bad):
    """``ChunkIndex`` had no upper bound (10**9 was taken) and the scheduler its own
    check; both now take ``check_block_size`` (1..16384, a ConfigError naming it)."""
    with BlockStore(StoreConfig(dram_bytes=1 << 20)) as store:
        with pytest.raises(ConfigError, match="block_size must be an int from 1 to"):
            ChunkIndex(store, block_size=bad)
        with pytest.raises(ConfigError, match="block_size must be an int from 1 to"):
            SpliceScheduler(store, bad)
        assert ChunkIndex(store, block_size=32).block_size == 32
        with pytest.raises(ConfigError, match="max_entries"):
            ChunkIndex(store, block_size=32, max_entries=True)
