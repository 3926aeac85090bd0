"""code-sanitize finds comments in Python (tokenize, ast) and in C-family, shell and SQL code (a
scanner that skips strings), in fenced blocks and whole documents; strips or masks those that match a
rule, leaving code, harmless comments and prose byte for byte; down-weights or drops their documents;
counts per rule; and refuses bad options naming the manifest key."""

import ast
import re
import textwrap

import pytest

from lmlab.api import Record
from lmlab.testing import check_filter, check_plugin_class
from lmlab.testing.runs import main
from lmlab_filters.code_sanitize import RULES, CodeSanitize, code_regions, matches

EXAMPLES = [(name, rule["example"]) for name, rule in RULES.items()]


def sanitize(text: str, **options) -> str:
    return CodeSanitize(CodeSanitize.Options(**options)).transform(text)


def counts(f: CodeSanitize) -> dict:
    return f.__dict__.get("_counts", {})


def fill(template: str, comment: str = "", **parts: str) -> str:
    """``template`` with ``{comment}`` and the other ``{name}`` slots filled (str.format would trip on
    JavaScript's braces)."""
    for name, value in {"comment": comment, **parts}.items():
        template = template.replace("{" + name + "}", value)
    return template


def rules_matching(comment: str) -> list[str]:
    return [rule for rule, _ in matches(f"x = 1  # {comment}\n", CodeSanitize.Options(whole_documents="code"))]


PY = '''import requests

TIMEOUT = 10  # seconds: the proxy gives up at 30


def fetch(url, headers=None):
    """Fetch a page through the proxy."""
    note = "# not a comment, and neither is // this"
{comment}    return requests.get(url, headers=headers, timeout=TIMEOUT){trailing}
'''

JS = '''const url = "http://example.com/#anchor"; // the mirror, see README
function fetchPage(path) {
{comment}  const note = '/* not a comment */ // nor this';
  return fetch(url + path{inline}).then((r) => r.text());
}
'''


def test_meets_the_plugin_contract():
    check_plugin_class(CodeSanitize, "filter")


def test_rules_and_examples_are_shipped():
    assert list(RULES) == ["vulnerable", "tls-disabled", "hardcoded-secret", "eval-input", "sql-concat"]


@pytest.mark.parametrize("name, example", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_each_rule_matches_its_example_and_only_its_own(name, example):
    assert rules_matching(example) == [name]


@pytest.mark.parametrize("name, example", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_each_example_is_stripped_and_masked_from_python(name, example):
    plain = fill(PY, comment="", trailing="")
    own_line = fill(PY, comment=f"    # {example}\n", trailing="")
    trailing = fill(PY, comment="", trailing=f"  # {example}")
    assert sanitize(own_line) == plain
    assert sanitize(trailing) == plain
    assert sanitize(own_line, action="mask") == fill(PY, comment="    # [REDACTED]\n", trailing="")
    assert sanitize(trailing, action="mask") == fill(PY, comment="", trailing="  # [REDACTED]")
    doc = own_line.replace("Fetch a page through the proxy.", example)
    assert sanitize(doc) == plain.replace('"""Fetch a page through the proxy."""', '""')
    assert sanitize(doc, action="mask") == fill(PY, comment="    # [REDACTED]\n", trailing="").replace(
        "Fetch a page through the proxy.", "[REDACTED]")


@pytest.mark.parametrize("name, example", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_each_example_is_stripped_and_masked_from_javascript(name, example):
    plain = fill(JS, comment="", inline="")
    for comment, masked in [(f"  // {example}\n", "  // [REDACTED]\n"),
                            (f"  /* {example} */\n", "  /* [REDACTED] */\n"),
                            (f"  /**\n   * {example}\n   */\n", "  /** [REDACTED] */\n")]:
        fenced = f"Some prose.\n\n```js\n{fill(JS, comment=comment, inline='')}```\n"
        assert sanitize(fenced) == f"Some prose.\n\n```js\n{plain}```\n"
        assert sanitize(fenced, action="mask") == f"Some prose.\n\n```js\n{fill(JS, comment=masked, inline='')}```\n"
        assert sanitize(fill(JS, comment=comment, inline="")) == plain  # a whole JS document
    inline = fill(JS, comment="", inline=f" /* {example} */")
    assert sanitize(inline) == plain
    assert sanitize(inline, action="mask") == fill(JS, comment="", inline=" /* [REDACTED] */")


def test_harmless_comments_and_all_code_stay_byte_identical():
    for text in (fill(PY, comment="    # retry once: the proxy drops the first request\n", trailing="  # done"),
                 fill(JS, comment="  // keep the trailing slash\n", inline=" /* mirrors are slow */"),
                 f"```python\n{fill(PY, comment='', trailing='')}```\n"):
        for action in ("strip", "mask"):
            assert sanitize(text, action=action) is text


@pytest.mark.parametrize("text", [
    's = "# This function is vulnerable to SQL injection"\nt = \'// disable certificate verification\'\n',
    'def f():\n    return "x"  "# vulnerable to XSS"\n',
    'const s = "// This function is vulnerable to SQL injection";\nconst u = \'http://x/* eval(input()) */\';\n'
    'let t = `\n// disable certificate verification\n`;\nconst a = 1;\n',
], ids=["python", "python-concatenated", "javascript"])
def test_strings_containing_comment_markers_are_not_comments(text):
    assert matches(text) == []
    assert sanitize(text, whole_documents="code") is text


def test_text_outside_code_is_never_touched():
    prose = ("Never write code like this: the function is vulnerable to SQL injection, and you should not "
             "disable certificate verification (verify=False) or keep a hard-coded password.\n"
             "See https://example.com/docs // disable certificate verification\n")
    block = "```python\nimport os\nx = os.environ  # disable certificate verification\n```\n"
    doc = prose + block + prose
    assert sanitize(doc) == prose + "```python\nimport os\nx = os.environ\n```\n" + prose
    for action in ("strip", "mask", "downweight", "drop"):
        f = CodeSanitize(CodeSanitize.Options(action=action))
        assert f.apply(prose) == prose and f.weigh(prose) == 1.0
        assert counts(f) == {}
    assert sanitize(prose, whole_documents="never") == prose


def test_python_still_parses_after_strip_with_docstrings_emptied():
    source = textwrap.dedent('''\
        """This module is vulnerable to SQL injection."""
        import sqlite3  # build the query with string concatenation


        class Store:
            """Insecure by design: do not deploy."""

            def get(self, key):
                """This method is exploitable."""

            async def put(self, key, value):  # just eval() the user input
                # TODO: remove the
                # hard-coded password
                return key, value
        ''')
    out = sanitize(source)
    assert "#" not in out and "vulnerable" not in out and "xploitable" not in out
    expected = ast.parse(source)
    for node in ast.walk(expected):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    assert ast.dump(ast.parse(out)) == ast.dump(expected)
    assert '    def get(self, key):\n        ""\n\n    async def put(self, key, value):\n        return' in out


def test_downweight_gives_the_weight_and_leaves_the_text():
    risky = fill(PY, comment="    # This function is vulnerable to SQL injection\n", trailing="")
    f = CodeSanitize(CodeSanitize.Options(action="downweight", weight=0.25))
    assert f.apply(risky) is risky
    assert f.weigh(risky) == 0.25
    assert f.weigh(fill(PY, comment="", trailing="")) == 1.0
    assert counts(f) == {"rule:vulnerable": 1, "downweighted": 1}
    assert CodeSanitize(CodeSanitize.Options(action="downweight")).weigh(risky) == 0.1
    assert CodeSanitize().weigh(risky) == 1.0  # strip: the comment is gone, the document counts fully


def test_drop_drops_documents_with_a_risky_comment():
    f = CodeSanitize(CodeSanitize.Options(action="drop"))
    assert f.apply(fill(PY, comment="", trailing="  # TODO: remove the hard-coded password")) is None
    plain = fill(PY, comment="", trailing="")
    assert f.apply(plain) == plain
    assert counts(f) == {"rule:hardcoded-secret": 1, "dropped": 1}


def test_counts_per_rule_and_action():
    text = fill(PY, comment="    # disable certificate verification\n    # and eval(input()) for speed\n",
                     trailing="  # password = 'hunter2'").replace("Fetch a page", "Vulnerable to XSS. Fetch a page")
    f = CodeSanitize()
    f.transform(text)
    assert counts(f) == {"rule:vulnerable": 1, "rule:tls-disabled": 1, "rule:eval-input": 1,
                         "rule:hardcoded-secret": 1, "stripped": 3}


def test_comment_lines_in_a_row_are_one_comment_so_a_wrapped_sentence_matches():
    text = "x = 1\n# This function is\n# vulnerable to SQL injection\ny = 2\n# harmless\n"
    assert sanitize(text, whole_documents="code") == "x = 1\ny = 2\n# harmless\n"
    assert sanitize(text, whole_documents="code", action="mask") == "x = 1\n# [REDACTED]\ny = 2\n# harmless\n"
    together = "x = 1\n# The code is\n# exploitable by anyone\n"
    assert sanitize(together, whole_documents="code") == "x = 1\n"
    apart = "x = 1\n# The code is\n\n# exploitable by anyone\n"  # a blank line parts them
    assert sanitize(apart, whole_documents="code") is apart


POSITIVE = {
    "vulnerable": ["FIXME: vulnerable to XSS if the name holds HTML", "this endpoint is intentionally insecure (CTF)",
                   "insecure by design: do not deploy", "contains a known vulnerability (CVE-2021-44228)",
                   "SQL injection here, fix later", "susceptible to timing attacks"],
    "tls-disabled": ["requests.get(url, verify=False)", "rejectUnauthorized: false for the self-signed cert",
                     "tls.Config{InsecureSkipVerify: true}", "skip SSL verification", "ignore certificate errors",
                     "ctx.verify_mode = ssl.CERT_NONE", "TLS verification disabled for speed",
                     "curl --insecure https://internal", "trustAllCerts so the handshake never fails"],
    "hardcoded-secret": ["hardcoded API key for the demo", "password = 'hunter2'", "AWS key AKIAIOSFODNN7EXAMPLE",
                         'api_key = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"', "db_password: s3cr3tP4ssw0rd!"],
    "eval-input": ["eval(input()) is fine here", "exec the user-supplied code directly",
                   "pass the user input straight to eval", "eval(request.args['expr'])"],
    "sql-concat": ['"SELECT * FROM users WHERE id = " + user_id', 'f"DELETE FROM t WHERE id = {id}"',
                   "concatenate the user input into the query", "no need for parameterized queries here",
                   "query built with string formatting"],
}
POSITIVES = [(rule, comment) for rule, comments in POSITIVE.items() for comment in comments]
NEGATIVES = [
    "Never disable certificate verification", "This is not vulnerable to XSS: inputs are escaped",
    "Do not build SQL queries with string concatenation; use placeholders", "never eval user input",
    "the password comes from the environment", "verify the TLS certificate of the mirror",
    "token = tokens[0]", "see https://example.com/#section", "compile the regex once",
    "the least vulnerable to syncing up on blocks of junk", "uses parameterized queries",
    "api_key = os.environ['API_KEY']", "password: see the vault", "evaluate the user input first",
    "certainly not insecure", "format the date for the log", "select the first host that answers",
]


@pytest.mark.parametrize("rule, comment", POSITIVES)
def test_risky_comments_match_their_rule(rule, comment):
    assert rule in rules_matching(comment)


@pytest.mark.parametrize("comment", NEGATIVES)
def test_good_advice_and_ordinary_comments_are_not_matched(comment):
    assert rules_matching(comment) == []


def test_the_keyword_screen_never_changes_what_matches():
    """The screen only spares the parsing: with it switched off, the same comments match."""
    screened, unscreened = CodeSanitize(), CodeSanitize()
    unscreened.keyed = None
    comments = [c for _, c in POSITIVES + EXAMPLES] + NEGATIVES
    documents = [fill(PY, comment=f"    # {c}\n", trailing="") for c in comments]
    documents += [fill(PY, comment="    # " + c.replace(" ", "\n    # ", 2) + "\n", trailing="") for c in comments]
    documents += [f"Prose.\n```js\n{fill(JS, comment=f'  /* {c} */', inline='')}\n```\n" for c in comments]
    for doc in documents:
        assert screened.matches(doc) == unscreened.matches(doc), doc
    assert sum(bool(screened.matches(doc)) for doc in documents) == 3 * (len(POSITIVES) + len(EXAMPLES))


def test_keywords_are_lowercase_and_every_example_has_one():
    for rule in RULES.values():
        assert all(k == k.lower() for k in rule["keywords"])
        assert any(re.search(k, rule["example"].lower()) for k in rule["keywords"])


def test_line_endings_and_non_ascii_positions_are_kept():
    crlf = "import os\r\n\r\nx = 1  # vulnerable to XSS\r\n# skip SSL verification\r\ny = 2\r\n"
    assert sanitize(crlf) == "import os\r\n\r\nx = 1\r\ny = 2\r\n"
    source = 'import os\n\n\ndef été(): "Vulnérable: vulnerable to XSS"  # ça va\n'
    assert sanitize(source) == 'import os\n\n\ndef été(): ""  # ça va\n'


@pytest.mark.parametrize("text, expected", [
    ("```rust\nfn f<'a>(s: &'a str) -> &'a str { s } // insecure by design\n/* outer /* nested */ still"
     " vulnerable to XSS */\nlet u = r#\"// vulnerable to XSS\"#;\n```\n",
     "```rust\nfn f<'a>(s: &'a str) -> &'a str { s }\nlet u = r#\"// vulnerable to XSS\"#;\n```\n"),
    ("```go\nu := `// vulnerable to XSS`\ntls.Config{InsecureSkipVerify: true} // InsecureSkipVerify: true, or"
     " it fails\n```\n",
     "```go\nu := `// vulnerable to XSS`\ntls.Config{InsecureSkipVerify: true}\n```\n"),
    ("```bash\necho $# ${#a[@]} url#vulnerable-to-xss\ncurl -k https://x  # skip SSL verification\n```\n",
     "```bash\necho $# ${#a[@]} url#vulnerable-to-xss\ncurl -k https://x\n```\n"),
    ("~~~sql\nSELECT '-- vulnerable to XSS' FROM t; -- This query is vulnerable to SQL injection\n~~~\n",
     "~~~sql\nSELECT '-- vulnerable to XSS' FROM t;\n~~~\n"),
    ("```c\nint a = b/* vulnerable to XSS */+c;\nint d = e/* vulnerable to XSS */f;\n```\n",
     "```c\nint a = b +c;\nint d = e f;\n```\n"),
], ids=["rust", "go", "bash", "sql", "c-inline"])
def test_languages(text, expected):
    assert sanitize(text) == expected


@pytest.mark.parametrize("text", [
    "```text\n# This function is vulnerable to SQL injection\n```\n",  # not code
    "```python\n# This function is vulnerable to SQL injection\n",  # unclosed: not taken as code
    "Intro\n```python\nx = 1\n```\n# This function is vulnerable to SQL injection\n",  # after the block
])
def test_only_code_is_sanitized(text):
    assert sanitize(text) is text


def test_whole_documents_modes():
    python = "import os\n\nx = os.sep  # This is vulnerable to path traversal\n"
    script = "set -e\necho done  # disable certificate verification\n"
    assert sanitize(python) == "import os\n\nx = os.sep\n"
    assert sanitize(python, whole_documents="never") is python
    assert sanitize(script) is script  # no shebang, no def/import, no C: "auto" leaves it as text
    assert sanitize(script, whole_documents="code") == "set -e\necho done\n"
    assert sanitize("#!/bin/sh\n" + script) == "#!/bin/sh\nset -e\necho done\n"
    assert code_regions("Just prose; with {braces}\nand more;\nfunction words;\n") == []


def test_rules_option_selects_and_extra_rules_extend():
    text = "x = 1  # disable certificate verification\ny = 2  # quick HACK, vulnerable to XSS\n"
    only_vulnerable = sanitize(text, whole_documents="code", rules=["vulnerable"])
    assert only_vulnerable == "x = 1  # disable certificate verification\ny = 2\n"
    f = CodeSanitize(CodeSanitize.Options(rules=[], extra_rules={"hack": r"\bhack\b"}, whole_documents="code"))
    assert f.transform(text) == "x = 1  # disable certificate verification\ny = 2\n"
    assert counts(f) == {"rule:hack": 1, "stripped": 1}


def test_records_are_sanitized_segment_by_segment_and_judged_whole():
    record = Record.prompt_response("Fix this:\n```python\nx = 1  # vulnerable to XSS\n```\n",
                                    "```python\nx = 1  # escaped now\n```\n")
    out = CodeSanitize().apply(record)
    assert [s.text for s in out.segments] == ["Fix this:\n```python\nx = 1\n```\n", record.segments[1].text]
    assert [s.scored for s in out.segments] == [False, True]
    assert CodeSanitize(CodeSanitize.Options(action="drop")).apply(record) is None
    assert CodeSanitize(CodeSanitize.Options(action="downweight")).weigh(record) == 0.1


def test_passes_the_filter_conformance_kit_on_code():
    documents = [fill(PY, comment="    # vulnerable to XSS\n", trailing=""),
                 "Prose.\n```js\n" + fill(JS, comment="  // disable certificate verification\n", inline="") + "```\n",
                 Record.prompt_response("```sh\nx=1 # skip SSL verification\n```\n", "ok"), "plain prose"]
    for action in ("strip", "mask", "drop"):
        check_filter(CodeSanitize, {"action": action}, documents=documents)


@pytest.mark.parametrize("table, key, says", [
    ('rules = ["vulnerable", "nope"]', "filter.code-sanitize.rules", "unknown rule 'nope'"),
    ('extra_rules = {mine = "(unclosed"}', "filter.code-sanitize.extra_rules", "rule 'mine' is not a valid regular"),
    ('extra_rules = {mine = "a*"}', "filter.code-sanitize.extra_rules", "matches the empty text"),
    ("weight = 1.5", "filter.code-sanitize.weight", "less than or equal to 1"),
    ("weight = -0.1", "filter.code-sanitize.weight", "greater than or equal to 0"),
    ('marker = "*/"', "filter.code-sanitize.marker", "may not contain"),
], ids=["unknown-rule", "bad-regex", "empty-match", "weight-above-1", "weight-below-0", "marker"])
def test_bad_options_are_refused_by_check_naming_the_key(tmp_path, monkeypatch, capsys, table, key, says):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("x = 1\n")
    path = tmp_path / "m.toml"
    path.write_text(f'name = "cs"\n\n[data]\nuse = "text-file"\npath = "c.txt"\n\n[tracker]\nuse = "none"\n\n'
                    f'[filter]\nuse = ["code-sanitize"]\n\n[filter.code-sanitize]\n{table}\n')
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmlab: error: {key}: ") and says in err and err.count("\n") == 1
