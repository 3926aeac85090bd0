"""pii-scrub replaces what it should (positive table) and leaves what only looks alike (negative table)."""

import pytest

from lmlab.api import Record
from lmlab.testing import check_plugin_class
from lmlab_filters.pii_scrub import PiiScrub

POSITIVE = [
    ("write to john.doe@example.com today", "write to [EMAIL] today"),
    ("mailto:a_b+tag@mail.co.uk.", "mailto:[EMAIL]."),
    ("call +1 (555) 123-4567 now", "call [PHONE] now"),
    ("call 555-123-4567", "call [PHONE]"),
    ("tel 555.123.4567", "tel [PHONE]"),
    ("London +44 20 7946 0958", "London [PHONE]"),
    ("(020) 7946 0958", "[PHONE]"),
    ("Berlin +49 30 1234567", "Berlin [PHONE]"),
    ("toll-free +1-800-555-0199.", "toll-free [PHONE]."),
    ("server 192.168.1.1 is down", "server [IP] is down"),
    ("ip=10.0.0.255.", "ip=[IP]."),
    ("addr 2001:db8::ff00:42:8329", "addr [IP]"),
    ("fe80::1%eth0 link-local", "[IP] link-local"),
    ("::ffff:192.0.2.128 mapped", "[IP] mapped"),
    ("2001:0db8:85a3:0000:0000:8a2e:0370:7334", "[IP]"),
    ("a@b.io and 1.2.3.4 and 555-123-4567", "[EMAIL] and [IP] and [PHONE]"),
]

NEGATIVE = [
    "user@localhost", "@decorator", "a @ b", "x@y.T", "date 2021-03-04", "years 1990-2000", "pi 3.14159",
    "version 3.11.7", "ISBN 978-3-16-148410-0", "1 000 000 people", "card 4111 1111 1111 1111", "a[1::2]",
    "x[::2]", "::1 loopback", "time 12:30:45", "std::vector", "mac 00:1A:2B:3C:4D:5E", "ratio 16:9", "999.1.1.1",
    "1.2.3", "10.0.0.256", "id 1234567", "SSN 123-45-6789", "range(10, 20)", "0x1F:0x2A", "deadbeef:cafe",
]


def scrub(text: str, **options) -> str:
    return PiiScrub(PiiScrub.Options(**options)).transform(text)


def test_meets_the_plugin_contract():
    check_plugin_class(PiiScrub, "filter")


@pytest.mark.parametrize("text, expected", POSITIVE)
def test_replaces_personal_data_with_placeholders(text, expected):
    assert scrub(text) == expected


@pytest.mark.parametrize("text", NEGATIVE)
def test_leaves_lookalikes_alone(text):
    assert scrub(text) == text


def test_each_kind_can_be_switched_off_and_its_token_chosen():
    text = "a@b.io 1.2.3.4 555-123-4567"
    assert scrub(text, emails=False, phones=False) == "a@b.io [IP] 555-123-4567"
    assert scrub(text, email_token="<email>") == "<email> [IP] [PHONE]"


def test_counts_replacements_by_kind():
    f = PiiScrub()
    f.transform("a@b.io c@d.org 10.0.0.1")
    assert f.__dict__["_counts"] == {"email": 2, "ip": 1}


def test_records_are_scrubbed_segment_by_segment():
    record = Record.prompt_response("mail a@b.io", "ok, 555-123-4567")
    out = PiiScrub().apply(record)
    assert [s.text for s in out.segments] == ["mail [EMAIL]", "ok, [PHONE]"]
    assert [s.scored for s in out.segments] == [False, True]
