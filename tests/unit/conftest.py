"""Unit-test fixtures: every scheduler a test drives to the end must give back every block."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit import scheduler_harness


@pytest.fixture(autouse=True)
def no_block_leaks() -> Iterator[None]:
    scheduler_harness.schedulers_in_test.clear()
    yield
    for scheduler in scheduler_harness.schedulers_in_test:
        if not scheduler.has_unfinished_requests():
            scheduler_harness.assert_no_leak(scheduler)
    scheduler_harness.schedulers_in_test.clear()
