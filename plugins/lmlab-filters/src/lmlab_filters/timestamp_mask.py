"""Absolute dates and times replaced by ``[TIME]``.

A timestamp in training text is mostly noise for a language model (log lines, e-mail headers,
"posted on ..."), and a model that memorises them learns stale facts about "now"; masking keeps the
place where a date goes. Matched, with an optional weekday before and an optional time (and time
zone) after a date, each whole expression becoming one ``[TIME]``:

- ISO 8601: ``2021-03-04``, ``2021-03-04T12:30:45.123Z``, ``2021-03-04 12:30+02:00``;
- written dates: ``4 March 2021``, ``4th of Mar. 2021``, ``March 4, 2021``, ``March 2021``, and RFC 2822
  (``Tue, 04 Mar 2021 12:30:45 GMT``) and C ``ctime`` (``Thu Mar  4 12:30:45 2021``) forms;
- numeric dates: ``03/04/2021``, ``4-3-21``, ``04.03.2021`` (dots only with a four-digit year, so
  version numbers stay), when one of the first two numbers is a month and the other a day;
- times of day: ``12:30``, ``23:59:59.5`` (two-digit hours, so a verse such as 3:16 or a ratio 16:9
  stays), ``3pm``, ``10:30 a.m.``, with an optional zone (``Z``, ``+02:00``, ``UTC``, ``CET``, ...).

Dates are found within a line. Not masked: years alone, relative expressions ("yesterday", "2 hours ago"), Unix timestamps (bare
numbers), and a two-digit-hour time inside brackets or braces (``a[10:20]``, ``{10:20}``). Each
expression masked is counted (``timestamps``) in the filter's report.
"""

import re

from lmlab.api import Field, Filter, Options

_MONTH = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
          r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?")
_WEEKDAY = (r"(?:mon(?:day)?|tue(?:s(?:day)?)?|wed(?:nesday)?|thu(?:r(?:s(?:day)?)?)?|fri(?:day)?"
            r"|sat(?:urday)?|sun(?:day)?)\.?,?\s+")
_DAY = r"(?:0?[1-9]|[12]\d|3[01])(?:st|nd|rd|th)?"
_YEAR = r"(?:1\d{3}|2\d{3})"
_ZONE = r"(?:\s?(?:Z|[+-](?:[01]\d|2[0-3]):?[0-5]\d|UTC|GMT|[ECMP][SD]T|CES?T|BST|IST|JST)(?![\w]))?"
_CLOCK = r"(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d(?:[.,]\d{1,9})?)?(?:\s?[ap]\.?m\.?(?!\w))?"
_TWELVE = r"(?:1[0-2]|0?[1-9])(?::[0-5]\d)?\s?[ap]\.?m\.?(?!\w)"
_TIME = rf"(?:{_CLOCK}|{_TWELVE}){_ZONE}"
_AT_TIME = rf"(?:(?:T|,?\s+(?:at\s+)?){_TIME})?"

_ISO = rf"\d{{4}}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?:(?:T|\s+){_TIME})?"
_WRITTEN = (rf"(?:{_WEEKDAY})?(?:{_DAY}\s+(?:of\s+)?{_MONTH},?\s+{_YEAR}"
            rf"|{_MONTH}\s+{_DAY},?\s+{_YEAR}"
            rf"|{_MONTH}\s+{_DAY}\s+{_TIME}\s+{_YEAR}"  # ctime: Thu Mar  4 12:30:45 2021
            rf"|{_MONTH}\s+{_YEAR}){_AT_TIME}")
_NUMERIC = rf"(?P<a>\d{{1,2}})(?P<sep>[/.-])(?P<b>\d{{1,2}})(?P=sep)(?P<year>\d{{4}}|\d{{2}}){_AT_TIME}"

WRITTEN = re.compile(rf"(?<![\w]){_WRITTEN}(?!\w)", re.IGNORECASE)
ISO = re.compile(rf"(?<![\w.:/-]){_ISO}(?![\w]|[.:/-]\d)")
NUMERIC = re.compile(rf"(?<![\w.:/-]){_NUMERIC}(?![\w]|[.:/-]\d)", re.IGNORECASE)
TIME = re.compile(rf"(?<![\w:.\[{{]){_TIME}(?![\w:]|[.,]\d)", re.IGNORECASE)

# What each form cannot do without, found by a cheap scan of the whole text: the full patterns then
# run only on the lines around these (a written date with its weekday costs ~10x a plain scan).
TRIGGERS = {
    ISO: re.compile(r"\d{4}-[01]\d-[0-3]\d"),
    WRITTEN: re.compile(r"(?<!\d)[12]\d{3}(?!\d)"),  # every written form has its year
    NUMERIC: re.compile(r"\d[/.-]\d\d?[/.-]\d\d"),
    TIME: re.compile(r"\d:[0-5]\d|\d\s?[ap]\.?m", re.IGNORECASE),
}


class TimestampMaskOptions(Options):
    token: str = Field("[TIME]", help="what a date or time becomes")


class TimestampMask(Filter):
    """``timestamp-mask``: absolute dates and times become ``[TIME]``."""

    Options = TimestampMaskOptions
    api = ">=1.3,<2"  # lmlab.api.Filter

    def transform(self, text: str) -> str:
        n = 0
        token = self.options.token

        def replace(m: re.Match) -> str:
            nonlocal n
            if m.re is NUMERIC and not _plausible(m):
                return m.group()
            n += 1
            return token

        for pattern in (ISO, WRITTEN, NUMERIC, TIME):  # longest forms first: a date swallows its time
            text = sub_lines(pattern, TRIGGERS[pattern], replace, text)
        if n:
            self.count("timestamps", n)
        return text


def sub_lines(pattern: re.Pattern, trigger: re.Pattern, replace, text: str) -> str:
    """``pattern.sub(replace, text)`` on the lines where ``trigger`` matches, the rest untouched."""
    out, done = [], 0
    for hit in trigger.finditer(text):
        if hit.start() < done:
            continue
        start = text.rfind("\n", 0, hit.start()) + 1
        end = text.find("\n", hit.end())
        end = len(text) if end < 0 else end + 1
        out += [text[done:start], pattern.sub(replace, text[start:end])]
        done = end
    return "".join(out) + text[done:] if out else text


def _plausible(m: re.Match) -> bool:
    """A numeric date: month and day in either order, and dots only with a four-digit year."""
    a, b = int(m.group("a")), int(m.group("b"))
    if m.group("sep") == "." and len(m.group("year")) != 4:
        return False
    return 1 <= a <= 31 and 1 <= b <= 31 and (a <= 12 or b <= 12)
