"""timestamp-mask masks absolute dates and times (positive table) and nothing that only looks alike."""

import pytest

from lmlab.testing import check_plugin_class
from lmlab_filters.timestamp_mask import TimestampMask

POSITIVE = [
    ("on 2021-03-04 we met", "on [TIME] we met"),
    ("at 2021-03-04T12:30:45.123Z", "at [TIME]"),
    ("2021-03-04 12:30+02:00 start", "[TIME] start"),
    ("born 4 March 2021.", "born [TIME]."),
    ("4th of Mar. 2021", "[TIME]"),
    ("March 4, 2021", "[TIME]"),
    ("in March 2021 it", "in [TIME] it"),
    ("Date: Tue, 04 Mar 2021 12:30:45 GMT", "Date: [TIME]"),
    ("Thu Mar  4 12:30:45 2021", "[TIME]"),
    ("due 03/04/2021", "due [TIME]"),
    ("4-3-21", "[TIME]"),
    ("04.03.2021", "[TIME]"),
    ("meet at 12:30", "meet at [TIME]"),
    ("23:59:59.5", "[TIME]"),
    ("at 3pm", "at [TIME]"),
    ("10:30 a.m. sharp", "[TIME] sharp"),
    ("15:00 UTC", "[TIME]"),
    ("Thursday, March 4, 2021 at 3pm", "[TIME]"),
    ("12/25/2021 10:00", "[TIME]"),
]

NEGATIVE = [
    "in 1999", "yesterday", "2 hours ago", "John 3:16", "ratio 16:9", "a[10:20]", "{10:20}", "version 3.10.12",
    "1.2.2", "1/2", "13/13/2021", "ip 10.0.0.1", "555-123-4567", "1614865845", "you may be 20", "we march on",
    "score 2-1", "pages 12-13", "3.14",
]


def mask(text: str) -> str:
    return TimestampMask().transform(text)


def test_meets_the_plugin_contract():
    check_plugin_class(TimestampMask, "filter")


@pytest.mark.parametrize("text, expected", POSITIVE)
def test_masks_absolute_dates_and_times(text, expected):
    assert mask(text) == expected


@pytest.mark.parametrize("text", NEGATIVE)
def test_leaves_what_is_no_timestamp(text):
    assert mask(text) == text


def test_counts_and_token_option():
    f = TimestampMask(TimestampMask.Options(token="<t>"))
    assert f.transform("2021-03-04 and 12:30") == "<t> and <t>"
    assert f.__dict__["_counts"] == {"timestamps": 2}
