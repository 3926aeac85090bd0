"""Personal data replaced by placeholder tokens: e-mail addresses, phone numbers, IP addresses.

Language models memorise and can be prompted to emit contact details from their training data
(Carlini et al. 2021, "Extracting Training Data from Large Language Models",
https://arxiv.org/abs/2012.07805). Replacing them with a placeholder keeps the sentence's shape, so
the model still learns that an address goes there, as BigScience's ROOTS pipeline did for e-mails and
IP addresses (Laurençon et al. 2022, https://arxiv.org/abs/2303.03915) and StarCoder's for code
(Li et al. 2023, https://arxiv.org/abs/2305.06161). Rules, applied in this order:

- e-mail: ``local@domain.tld`` with a dotted domain and an alphabetic top-level label
  (``user@localhost`` stays);
- IP: IPv6 (validated by :mod:`ipaddress`, with a zone or an embedded IPv4 address) when it has three
  non-empty groups or one of three or more hex digits, so Python slices such as ``a[1::2]`` and the
  loopback ``::1`` stay; IPv4 as four dotted numbers 0-255 (a four-part version number such as
  1.2.3.4 cannot be told apart and is masked too);
- phone: 7 to 15 digits (E.164's range) in groups separated by spaces, dots or dashes, that either
  start with a ``+country`` code, put the area code in parentheses, or have the North-American
  3-3-4 shape (``555-123-4567``). Dates, numbers with thousands separators, ISBNs and credit-card
  numbers do not match; a national number written without any of these marks (``030 1234567``)
  is not recognised.

Each replacement is counted (``email``, ``ip``, ``phone``) in the filter's report.
"""

import ipaddress
import re

from lmlab.api import Field, Filter, Options
from lmlab_filters.timestamp_mask import sub_lines

EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
                   r"[A-Za-z]{2,63}(?![\w-])")
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{1,4})?"
                  r"(?:%[\w.]+)?(?![\w:])")
OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = re.compile(rf"(?<![\w.]){OCTET}(?:\.{OCTET}){{3}}(?!\.?\w)")
PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,5}\)[ .-]?)?\d{1,5}(?:[ .-]\d{2,8}){1,4}(?![\w]|[.-]\d)")
NORTH_AMERICAN = re.compile(r"\d{3}([ .-])\d{3}\1\d{4}")

# What each form cannot do without, found by a cheap scan of the whole text: the full patterns then
# run only on the lines around these.
TRIGGERS = {
    EMAIL: re.compile(r"@[A-Za-z0-9-]+\."),
    IPV6: re.compile(r":[0-9A-Fa-f]*:"),
    IPV4: re.compile(r"\d\.\d{1,3}\.\d{1,3}\.\d"),
    PHONE: re.compile(r"\d[ .-]\(?\d\d"),
}


class PiiScrubOptions(Options):
    emails: bool = Field(True, help="replace e-mail addresses")
    ips: bool = Field(True, help="replace IPv4 and IPv6 addresses")
    phones: bool = Field(True, help="replace phone numbers")
    email_token: str = Field("[EMAIL]", help="what an e-mail address becomes")
    ip_token: str = Field("[IP]", help="what an IP address becomes")
    phone_token: str = Field("[PHONE]", help="what a phone number becomes")


class PiiScrub(Filter):
    """``pii-scrub``: e-mail addresses, IP addresses and phone numbers become placeholders."""

    Options = PiiScrubOptions
    api = ">=1.3,<2"  # lmlab.api.Filter

    def transform(self, text: str) -> str:
        o = self.options
        if o.emails:
            text = self._sub(EMAIL, text, lambda m: o.email_token, "email")
        if o.ips:
            text = self._sub(IPV6, text, lambda m: o.ip_token if is_ipv6(m.group()) else None, "ip")
            text = self._sub(IPV4, text, lambda m: o.ip_token, "ip")
        if o.phones:
            text = self._sub(PHONE, text, lambda m: o.phone_token if is_phone(m.group()) else None, "phone")
        return text

    def _sub(self, pattern: re.Pattern, text: str, replacement, what: str) -> str:
        n = 0

        def replace(m: re.Match) -> str:
            nonlocal n
            out = replacement(m)
            if out is None:
                return m.group()
            n += 1
            return out

        text = sub_lines(pattern, TRIGGERS[pattern], replace, text)
        if n:
            self.count(what, n)
        return text


def is_ipv6(candidate: str) -> bool:
    address = candidate.split("%", 1)[0]
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    groups = [g for g in re.split(r":", address) if g]
    return len(groups) >= 3 or any(len(g) >= 3 for g in groups)


def is_phone(candidate: str) -> bool:
    digits = sum(c.isdigit() for c in candidate)
    if not 7 <= digits <= 15:
        return False
    return candidate.startswith("+") or "(" in candidate or NORTH_AMERICAN.fullmatch(candidate) is not None
