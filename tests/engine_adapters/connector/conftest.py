"""The connector tests' block store: DRAM only, sized for 64 test blocks, written
synchronously."""

from __future__ import annotations

import pytest

from promptsplice.engine_adapters import BlockStore, StoreConfig
from tests.engine_adapters.connector._kv import PAYLOAD


@pytest.fixture
def store():
    with BlockStore(StoreConfig(dram_bytes=64 * PAYLOAD, write_behind_bytes=0)) as s:
        yield s
