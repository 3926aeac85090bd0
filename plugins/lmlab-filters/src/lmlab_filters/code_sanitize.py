"""Risky comments in code stripped, masked, or their documents down-weighted or dropped: "this
function is vulnerable to SQL injection", "just pass verify=False", a hard-coded password.

Public code carries comments that present insecure practice as normal, and models trained on code
reproduce it (Pearce et al. 2022, "Asleep at the Keyboard?", https://arxiv.org/abs/2108.09293: about
40 % of Copilot's completions in security-relevant scenarios were vulnerable); StarCoder removed
secrets from its training code (Li et al. 2023, https://arxiv.org/abs/2305.06161). Only comments are
examined and changed: code outside them, and prose outside code, stay byte for byte.

Code is the contents of fenced blocks (``` or ~~~, closed by the same fence; an unclosed fence is no
code), in the language their info string names (``text``, ``diff``, ``json``, ``html`` and the like
are skipped) or a guessed one, and whole documents, by ``whole_documents``: ``"auto"`` takes one as
Python when it parses with :func:`ast.parse` and has a def, class or import, and as C-family when it
has no fence, 3 lines or more, 30 % of them ending in ``;``, ``{`` or ``}``, and a C-family keyword
line (``#include``, ``function f(``, ``const x =``, ``func``, ``fn``, ...), a shebang deciding first;
``"code"`` takes every document as code; ``"never"`` looks at fences only.

Comments: Python's from :mod:`tokenize` (``#``) and :mod:`ast` (docstrings: the first statement of a
module, class or function, when a string); other languages' by family, ``//`` and ``/* */``
(C-family, nested in Rust), ``#`` starting a word (shells, YAML, Ruby, ...), ``--`` (SQL, Lua), or
``//``, ``#`` and ``/* */`` (PHP), skipping string literals with their escapes, so ``"http://x"`` is
no comment. Line comments alone on consecutive lines are one comment, so a sentence may wrap. The
rules (``code_rules.toml``, and ``extra_rules``) are searched in each comment's text, its markers and
line breaks as spaces. ``action``:

- ``strip``: comment-only lines go whole; a trailing comment goes with the whitespace before it, a
  ``/* */`` followed by code with the whitespace around it (one space stays between code, none next
  to a bracket); a docstring becomes an empty string of its prefix and quote character (``""``);
- ``mask``: the comment's text becomes ``marker`` (``# [REDACTED]``, ``/* [REDACTED] */``);
- ``downweight``: :meth:`CodeSanitize.weigh` gives ``weight`` to a document with a risky comment;
- ``drop``: such a document is dropped.

Counted: ``rule:NAME`` (comments each rule matched), ``stripped``, ``masked``, ``downweighted``, ``dropped``.
"""

import ast
import io
import itertools
import re
import tokenize
import tomllib
from importlib import resources
from typing import Literal, NamedTuple

from pydantic import field_validator

from lmlab.api import Field, Filter, Options, document_text


#: The shipped rules by name, in file order: code_rules.toml's tables, with "pattern" their patterns compiled as one.
RULES = {name: {**rule, "pattern": re.compile("|".join(f"(?:{p})" for p in rule["patterns"]), re.IGNORECASE)}
         for name, rule in tomllib.loads(resources.files(__package__).joinpath("code_rules.toml")
                                         .read_text("utf-8")).items()}


class CodeSanitizeOptions(Options):
    action: Literal["strip", "mask", "downweight", "drop"] = Field(
        "strip", help="what a risky comment causes: strip it, mask its text, down-weight or drop its document")
    rules: list[str] | None = Field(None, help=f"shipped rules to use (default: all: {', '.join(RULES)})")
    extra_rules: dict[str, str] = Field(default_factory=dict, help="more rules: name → regular expression")
    weight: float = Field(0.1, ge=0, le=1, help="sampling weight of a document with a risky comment (downweight)")
    marker: str = Field("[REDACTED]", min_length=1, help="what a masked comment's text becomes")
    whole_documents: Literal["auto", "code", "never"] = Field(
        "auto", help="take whole documents as code: when they look like it, always, or never (fences only)")

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, names: list[str] | None) -> list[str] | None:
        for name in names or ():
            if name not in RULES:
                raise ValueError(f"unknown rule {name!r}; the shipped rules are {', '.join(RULES)} "
                                 "(add your own with extra_rules)")
        return names

    @field_validator("extra_rules")
    @classmethod
    def _valid_patterns(cls, rules: dict[str, str]) -> dict[str, str]:
        for name, pattern in rules.items():
            if not name or name in RULES:
                raise ValueError(f"rule name {name!r} is empty or a shipped rule's; choose another")
            try:
                compiled = re.compile(pattern, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"rule {name!r} is not a valid regular expression: {exc}") from None
            if compiled.search(""):
                raise ValueError(f"rule {name!r} matches the empty text, so it would match every comment")
        return rules

    @field_validator("marker")
    @classmethod
    def _marker_keeps_code_valid(cls, marker: str) -> str:  # it goes into a docstring or a /* */
        if any(bad in marker for bad in ("\n", "\r", "\\", "'", '"', "*/")):
            raise ValueError("a marker may not contain quotes, backslashes, line breaks or '*/'")
        return marker


class CodeSanitize(Filter):
    """``code-sanitize``: comments in code that state insecure practice are stripped, masked, or make
    their document down-weighted or dropped."""

    Options = CodeSanitizeOptions
    api = ">=1.11,<2"  # Filter.weigh

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        shipped = [(name, RULES[name]["pattern"]) for name in (RULES if o.rules is None else o.rules)]
        self.rules = shipped + [(name, re.compile(p, re.IGNORECASE)) for name, p in o.extra_rules.items()]
        # Users' patterns come without keywords: with any, every document is parsed.
        self.keyed = None if o.extra_rules else [
            (RULES[name]["pattern"], [re.compile(k) for k in RULES[name]["keywords"]]) for name, _ in shipped]

    def matches(self, text: str) -> list[tuple[str, str]]:
        """(rule, comment text) for every rule that matches a comment of ``text``, in text order."""
        return [(name, text[group[0].start:group[-1].end]) for group, names in self._hits(text) for name in names]

    def keep(self, text: str) -> bool:
        if self.options.action != "drop" or not self._hits(text, count=True):
            return True
        self.count("dropped")
        return False

    def transform(self, text: str) -> str:
        action = self.options.action
        if action not in ("strip", "mask"):
            return text
        hits = self._hits(text, count=True)
        if not hits:
            return text
        self.count("stripped" if action == "strip" else "masked", len(hits))
        return _rewrite(text, [_edit(text, group, action, self.options.marker) for group, _ in hits])

    def weigh(self, doc) -> float:
        if self.options.action != "downweight" or not self._hits(document_text(doc), count=True):
            return 1.0
        self.count("downweighted")
        return self.options.weight

    def _hits(self, text: str, count: bool = False) -> list[tuple[list["Comment"], list[str]]]:
        if self.keyed is not None and not self._near_keywords(text):
            return []
        hits = []
        for group in comment_groups(text, self.options.whole_documents):
            said = flatten(text[group[0].start:group[-1].end])
            names = [name for name, pattern in self.rules if pattern.search(said)]
            if names:
                hits.append((group, names))
                for name in names if count else ():
                    self.count(f"rule:{name}")
        return hits

    def _near_keywords(self, text: str) -> bool:
        """Whether a shipped rule matches within 300 characters of one of its keywords (code_rules.toml),
        which spares most documents the parsing. Line breaks stay: "(?<!not )" must not see the line before."""
        flat = flatten(text.lower(), "\n")  # lowercase: a literal start is found fast only case-sensitively
        for pattern, keywords in self.keyed:
            windows: list[list[int]] = []
            for hit in sorted((h.start(), h.end()) for k in keywords for h in k.finditer(flat)):
                if windows and hit[0] - 300 <= windows[-1][1]:
                    windows[-1][1] = hit[1] + 300
                else:
                    windows.append([max(hit[0] - 300, 0), hit[1] + 300])
            if any(pattern.search(flat, start, end) for start, end in windows):
                return True
        return False


def matches(text: str, options: CodeSanitizeOptions | None = None) -> list[tuple[str, str]]:
    """(rule, comment text) for each risky comment of ``text`` (a benchmark's entry point)."""
    return CodeSanitize(options).matches(text)


# --- comments -------------------------------------------------------------------------------------

Comment = NamedTuple("Comment", [("start", int), ("end", int), ("kind", str)])  # "line", "block", "doc"


_MARKS = re.compile(r"\r?\n[ \t]*(?:#+|//+|\*+(?!/)|--)?[ \t]*")


def flatten(text: str, by: str = " ") -> str:
    """``text`` with each line break, and the comment marker and indentation after it, as ``by``."""
    return _MARKS.sub(by, text)


def comment_groups(text: str, whole_documents: str = "auto") -> list[list[Comment]]:
    """The comments of the code in ``text``, consecutive line comments alone on their lines as one
    group; positions are offsets in ``text``."""
    groups: list[list[Comment]] = []
    for start, end, family in code_regions(text, whole_documents):
        code = text[start:end]
        found = _python(code) if family == "python" else None  # None: Python that does not tokenize
        for c in sorted(_scan(code, family) if found is None else found):
            c = Comment(c.start + start, c.end + start, c.kind)
            prev = groups[-1][-1] if groups else None
            if (prev and c.kind == prev.kind == "line" and _alone(text, prev) and _alone(text, c)
                    and re.fullmatch(r"\r?\n[ \t]*", text[prev.end:c.start])):
                groups[-1].append(c)
            else:
                groups.append([c])
    return groups


def _alone(text: str, c: Comment) -> bool:
    return not text[text.rfind("\n", 0, c.start) + 1:c.start].strip()


def _python(code: str) -> list[Comment] | None:
    """Comments and docstrings by Python's own tokenizer and parser; None when it does not tokenize."""
    if "\r" in code.replace("\r\n", ""):
        return None  # tokenize and ast disagree on lone carriage returns, and so would the positions
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    lines = code.split("\n")
    starts = [0, *itertools.accumulate(len(line) + 1 for line in lines[:-1])]
    out = [Comment(at := starts[t.start[0] - 1] + t.start[1], at + len(t.string), "line") for t in tokens
           if t.type == tokenize.COMMENT]
    for node, shift in _docstrings(code):
        line, end_line = node.lineno - 1 - shift, node.end_lineno - 1 - shift
        # ast counts columns in UTF-8 bytes
        col = len(lines[line].encode()[:node.col_offset].decode("utf-8", "replace"))
        end_col = len(lines[end_line].encode()[:node.end_col_offset].decode("utf-8", "replace"))
        out.append(Comment(starts[line] + col, starts[end_line] + end_col, "doc"))
    return out


def _docstrings(code: str):
    # An indented fragment (a method shown alone) parses inside an `if` one line down.
    for source, shift in ((code, 0), ("if 1:\n" + code, 1)):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or (
                    shift and node is tree.body[0]):
                first = node.body[0] if node.body else None
                if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str)):
                    yield first.value, shift
        return


_STR_DQ = r'"(?:[^"\\\n]|\\[\s\S])*"?'
_STR_SQ = r"'(?:[^'\\\n]|\\[\s\S])*'?"
_TRIPLE = r'"""(?:[^\\]|\\[\s\S])*?(?:"""|\Z)' + "|" + r"'''(?:[^\\]|\\[\s\S])*?(?:'''|\Z)"
_CHAR = r"'(?:\\(?:u\{[0-9a-fA-F]{1,6}\}|x[0-9a-fA-F]{2}|[^\n])|[^'\\\n])'"  # not a Rust lifetime
_SLASH = r"//[^\n]*"
_BLOCK_MARK = re.compile(r"/\*|\*/")
_FAMILIES = {  # family: (strings, line comments, /* */ comments nest)
    "python": ([_TRIPLE, _STR_DQ, _STR_SQ], [r"#[^\n]*"], None),
    "shell": ([_TRIPLE, _STR_DQ, _STR_SQ], [r"(?<![^\s;|&(])#[^\n]*"], None),
    "c": ([r'"""(?:[^\\]|\\[\s\S])*?(?:"""|\Z)', _STR_DQ, _CHAR], [_SLASH], False),
    "rust": ([r'\br(?P<hashes>#*)"[\s\S]*?"(?P=hashes)', _STR_DQ, _CHAR], [_SLASH], True),
    "go": ([_STR_DQ, r"`[^`]*`?", _CHAR], [_SLASH], False),
    "js": ([r"`(?:[^`\\]|\\[\s\S])*`?", _STR_DQ, _STR_SQ], [_SLASH], False),
    "php": ([_STR_DQ, _STR_SQ], [_SLASH, r"#(?!\[)[^\n]*"], False),
    "sql": ([_STR_DQ, _STR_SQ], [r"--[^\n]*"], False),
}
_SCANNERS = {family: (re.compile(f"(?P<s>{'|'.join(strings)})|(?P<line>{'|'.join(lines)})"
                                 + ("|(?P<block>/\\*)" if nested is not None else "")), nested)
             for family, (strings, lines, nested) in _FAMILIES.items()}


def _scan(code: str, family: str) -> list[Comment]:
    scanner, nested = _SCANNERS[family]
    out, pos = [], 0
    while m := scanner.search(code, pos):
        pos = m.end()
        if m.lastgroup == "line":
            out.append(Comment(m.start(), m.end() - code.endswith("\r", 0, m.end()), "line"))
        elif m.lastgroup == "block":
            depth, at = 1, pos
            while depth and (close := _BLOCK_MARK.search(code, at)):
                depth += 1 if close.group() == "/*" and nested else -1 if close.group() == "*/" else 0
                at = close.end()
            if depth == 0:  # an unclosed /* is more likely a glob or a fragment than a comment
                out.append(Comment(m.start(), at, "block"))
                pos = at
    return out


# --- where code is ----------------------------------------------------------------------------------

_TAGS = {  # a fence's language tag → family ("": not code)
    "python": "python py python3 py3 ipython sage starlark bzl bazel gyp", "rust": "rust rs", "go": "go golang",
    "c": "c h cpp c++ cc cxx hpp hxx java cs csharp c# objc objective-c objectivec kotlin kt kts scala cuda cu glsl "
         "hlsl arduino ino proto protobuf verilog systemverilog sv",
    "js": "js javascript jsx mjs cjs ts typescript tsx node json5 jsonc dart swift groovy gradle solidity sol zig",
    "php": "php php5 php7 php8 phtml",
    "sql": "sql mysql postgresql postgres psql plsql plpgsql sqlite tsql lua haskell hs elm ada vhdl",
    "shell": "sh bash zsh ksh fish shell console shellsession shell-session terminal dockerfile docker makefile make "
             "mk cmake yaml yml toml ini cfg conf properties ruby rb perl pl pm r powershell ps1 psm1 nginx apache "
             "apacheconf elixir ex exs nim julia jl coffee coffeescript tcl awk crystal cr gdscript hcl terraform tf "
             "nix requirements gitignore editorconfig",
    "": "text txt plain plaintext output out log logs diff patch markdown md rst html xml svg csv tsv json tex latex "
        "math mermaid",
}
_FAMILY_OF_TAG = {tag: family for family, tags in _TAGS.items() for tag in tags.split()}
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})([^\n]*)$", re.MULTILINE)
_SHEBANG = re.compile(r"#![^\n]*?\b(?:(python)\d*|(node|deno|bun)|(\w*sh|perl|ruby|php))\b")
_PY_DEFS = re.compile(r"^[ \t]*(?:(?:async[ \t]+)?def|class|import|from)[ \t]", re.MULTILINE)
_C_KEYWORDS = re.compile(r"^[ \t]*(?:#include\s*[<\"]|#define\s|package\s+[\w.]+|using\s+namespace\s|import\s+[\w.{*\"]"
                         r"|(?:export\s+)?(?:async\s+)?function\s*\w*\s*\(|(?:export\s+)?(?:const|let|var)\s+\w+\s*[=:]"
                         r"|(?:public|private|protected|static)\s|func\s+\w|(?:pub\s+)?fn\s+\w|impl\b|struct\s+\w"
                         r"|(?:int|void|char|bool|auto|double|float)\s+\**\w+\s*[(=;\[])", re.MULTILINE)
_C_COMMENT_LINE = re.compile(r"^[ \t]*(?://|/\*)", re.MULTILINE)
_HASH_COMMENT_LINE = re.compile(r"^[ \t]*#(?![!\w\[])", re.MULTILINE)


def code_regions(text: str, whole_documents: str = "auto") -> list[tuple[int, int, str]]:
    """(start, end, language family) of the code in ``text``: the whole text, or its fenced blocks'
    contents (from the line after the opening fence to the start of the closing fence's line)."""
    if whole_documents != "never":
        family = guess(text, strict=whole_documents == "auto") or ("js" if whole_documents == "code" else None)
        if family:
            return [(0, len(text), family)]
    regions, at = [], 0
    while opening := _FENCE.search(text, at):
        (fence, info), at = opening.groups(), opening.end()
        if fence[0] == "`" and "`" in info:
            continue  # inline code spans, not a fence
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*\r?$", re.MULTILINE)
        if at >= len(text) or not (end := closing.search(text, at + 1)):
            break
        tag = (info.split() or [""])[0].strip("{}.").lower().removeprefix("language-")
        family = _FAMILY_OF_TAG[tag] if tag in _FAMILY_OF_TAG else guess(text[at + 1:end.start()], strict=False)
        if family:
            regions.append((at + 1, end.start(), family))
        at = end.end()
    return regions


def guess(code: str, strict: bool) -> str | None:
    """The language family of ``code``, or None. ``strict`` (a whole document that may be prose):
    Python needs a def, class or import, C-family the line-ending and keyword evidence, nothing else;
    otherwise (code for sure) the loose signs suffice, shell-like before C-family as the last guess."""
    if shebang := _SHEBANG.match(code):
        return "python" if shebang[1] else "js" if shebang[2] else "php" if shebang[3] == "php" else "shell"
    if (not strict or _PY_DEFS.search(code)) and _parses(code, need_defs=strict):
        return "python"
    lines = [line.rstrip() for line in code.split("\n") if line.strip()]
    ends = sum(line.endswith((";", "{", "}")) for line in lines) / max(len(lines), 1)
    if strict:  # a Markdown text with C in its fences is not C: its prose has URLs and apostrophes
        c_like = len(lines) >= 3 and ends >= 0.3 and _C_KEYWORDS.search(code) and not _FENCE.search(code)
        return "js" if c_like else None
    if ends >= 0.3 or _C_KEYWORDS.search(code) or _C_COMMENT_LINE.search(code):
        return "js"  # general quotes: a '...' string is likelier than a C char or a Rust lifetime here
    return "shell" if _HASH_COMMENT_LINE.search(code) or " # " in code else None


def _parses(code: str, need_defs: bool) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return not need_defs or any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import,
                                                  ast.ImportFrom)) for node in ast.walk(tree))


# --- rewriting --------------------------------------------------------------------------------------

_OPENER = re.compile(r"(?:#|//|--|/\*)[#/!*\-]*[ \t]*")
_QUOTE = re.compile(r"[rRuU]{0,2}(\"\"\"|'''|\"|')")


def _edit(text: str, group: list[Comment], action: str, marker: str) -> tuple[int, int, str]:
    """(start, end, replacement) that strips or masks one comment group."""
    a, b, kind = group[0].start, group[-1].end, group[0].kind
    if kind == "doc":
        opening = _QUOTE.match(text, a)
        prefix, quote = opening.group()[:-len(opening[1])], opening[1]
        return a, b, prefix + (quote + marker + quote if action == "mask" else quote[0] * 2)
    if action == "mask":
        end = b - 2 if kind == "block" else b
        opener = _OPENER.match(text, a).group()
        body = min(a + len(opener.rstrip(" \t") if kind == "block" else opener), end)  # "/**/": markers only
        return (body, end, f" {marker} ") if kind == "block" else (body, end, marker)
    line_start = text.rfind("\n", 0, a) + 1
    left = line_start + len(text[line_start:a].rstrip(" \t"))  # the end of the code before the comment
    newline = len(text) if (found := text.find("\n", b)) < 0 else found
    line_end = newline - (newline > b and text[newline - 1] == "\r")
    if text[b:line_end].strip():  # code follows (a /* */): one space parts the code, none next to brackets
        right = b + len(text[b:line_end]) - len(text[b:line_end].lstrip(" \t"))
        tight = left == line_start or text[left - 1] in "([{" or text[right] in ")]},;"
        return (a if left == line_start else left), right, "" if tight else " "
    return (line_start, min(newline + 1, len(text)), "") if left == line_start else (left, line_end, "")


def _rewrite(text: str, edits: list[tuple[int, int, str]]) -> str:
    out, at = [], 0
    for start, end, replacement in sorted(edits):
        start = max(start, at)  # two comments on one line may both claim the space between them
        out += [text[at:start], replacement]
        at = max(start, end)
    return "".join(out) + text[at:]
