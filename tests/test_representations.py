"""The time format every representation and event envelope uses (SPEC §3: ISO 8601, UTC, milliseconds)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from protocol import representations as rep


@pytest.mark.parametrize(("moment", "text"), [
    (datetime(2026, 11, 30, 23, 59, 59, 123999, tzinfo=UTC), "2026-11-30T23:59:59.123Z"),
    # Another offset is shown in UTC, the date rolling over with it.
    (datetime(2026, 12, 1, 1, 0, 0, 5000, tzinfo=timezone(timedelta(hours=2))), "2026-11-30T23:00:00.005Z"),
    # Microseconds are cut, never rounded up into the next second.
    (datetime(2026, 1, 1, 0, 0, 0, 999999, tzinfo=UTC), "2026-01-01T00:00:00.999Z"),
    # Four-digit years, as ISO 8601 asks (the C library's %Y wrote "1-01-02...").
    (datetime(1, 1, 2, 3, 4, 5, tzinfo=UTC), "0001-01-02T03:04:05.000Z"),
])
def test_format_time_is_utc_with_milliseconds_and_a_z(moment: datetime, text: str) -> None:
    assert rep.format_time(moment) == text
