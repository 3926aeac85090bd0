"""The examples in README.md and the manual (docs/guide/), read from their fenced blocks and run.

A page's examples run in page order in one folder of its own (copies of experiments/ and data/,
scripts/ linked in, and whatever earlier examples on the page wrote):

- ```bash: one bash script (``set -euo pipefail``); ``.venv/bin/`` before a command is dropped (the
  suite's own lmlab runs it). A block with no language (or ``text``) right after it is what it
  prints: each non-blank line must appear, in order, in its stdout and stderr, where any number
  matches any number, ``...`` anything, and a run of spaces any run of spaces.
- A block with no language (or ``console``) whose first line starts with ``$ ``: a terminal session,
  its ``$ `` lines the script, its other lines what it prints (matched as above).
- ```toml file=NAME, ```python file=NAME (any language with ``file=``): written to NAME.
- ```toml: a manifest, or a part of one, checked with ``lmlab check`` beside the shipped manifests in
  experiments/ (a missing ``name`` and ``[data]`` supplied).
- ```python: run with the suite's interpreter.

An HTML comment on the line before the opening fence (invisible on the rendered page) says more:
``<!-- not run: REASON -->`` (what it needs that the suite has not: a GPU, a cluster, the internet),
``<!-- run with: ARGS -->`` (ARGS appended to every ``lmlab run`` of the block, so that the suite
trains a few steps where the page trains thousands), ``<!-- exit: N -->`` (the last command exits N),
``<!-- not output -->`` (a block after a bash block that is not what it prints: a listing, a map),
``<!-- setup: COMMANDS -->`` (run first, unchecked: what the page assumes the reader has, e.g. a
trained quickstart run).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(`{3,})\s*([^`]*)$")
DIRECTIVE = re.compile(r"^<!--\s*(not run|run with|exit|not output|setup)\s*:?\s*(.*?)\s*-->$")
NUMBER = r"[-+]?(?:\d[\d,_]*)?\.?\d+(?:[eE][-+]?\d+)?"
TOKEN = re.compile(r"(\.\.\.)|(" + NUMBER + r")|(\s+)|(.)")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    file: str | None
    text: str
    not_run: str | None = None
    run_with: str = ""
    exit: int = 0
    output: str | None = None  # the quoted output of a bash block
    setup: str = ""  # commands run first, not shown on the page

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}, line {self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs" / "guide").glob("*.md"))]


def _blocks(lines: list[str]):
    """(line, info, body, directives, the line before the directives, the line after the closing fence)
    for every fenced block of a page's lines (0-based but the first, the opening fence's, 1-based)."""
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start = match.group(1), match.group(2).strip(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and not lines[j].strip()[len(fence):].strip()), len(lines))
        directives, k = {}, start - 1
        while k >= 0 and (found := DIRECTIVE.match(lines[k].strip())):
            directives[found.group(1)] = found.group(2)
            k -= 1
        blank_before = k  # the last line before the directives: blank or not
        yield start + 1, info, "\n".join(lines[start + 1:end]), directives, blank_before, end + 1
        i = end + 1


def examples(page: Path) -> list[Example]:
    found: list[Example] = []
    text = page.read_text()
    lines = text.split("\n")
    previous_end = None
    for line, info, body, directives, before, after in _blocks(lines):
        words = info.split()
        lang = words[0] if words and "=" not in words[0] else ""
        attrs = dict(w.split("=", 1) for w in words if "=" in w)
        follows_bash = (found and found[-1].lang == "bash" and found[-1].output is None and previous_end is not None
                        and all(not l.strip() for l in lines[previous_end:before + 1]))
        previous_end = after
        if lang in ("", "text", "console") and body.lstrip().startswith("$ "):  # a session: commands and output
            commands, printed, continued = [], [], False
            for text_line in body.split("\n"):
                if text_line.startswith("$ ") or continued:
                    commands.append(text_line[2:] if text_line.startswith("$ ") and not continued else text_line)
                    continued = text_line.endswith("\\")
                else:
                    printed.append(text_line)
            printed = "\n".join(printed)
            found.append(Example(page, line, "bash", None, "\n".join(commands), directives.get("not run"),
                                 directives.get("run with", ""), int(directives.get("exit", 0)), printed,
                                 directives.get("setup", "")))
            continue
        if lang in ("", "text") and "file" not in attrs:
            if follows_bash and "not output" not in directives:
                found[-1] = replace(found[-1], output=body)
            continue
        if lang not in ("bash", "toml", "python") and "file" not in attrs:
            continue
        found.append(Example(page, line, lang, attrs.get("file"), body, directives.get("not run"),
                             directives.get("run with", ""), int(directives.get("exit", 0)),
                             setup=directives.get("setup", "")))
    return found


def not_run_reasons(root: Path = ROOT) -> Counter:
    return Counter(e.not_run for p in pages(root) for e in examples(p) if e.not_run is not None)


# --- running one ---------------------------------------------------------------------------------

def sandbox(folder: Path) -> Path:
    """The folder a page's examples run in: copies of experiments/ and data/ (examples write beside
    manifests and corpora), scripts/ linked."""
    if not (folder / "experiments").exists():
        folder.mkdir(parents=True, exist_ok=True)
        if (ROOT / "experiments").is_dir():
            shutil.copytree(ROOT / "experiments", folder / "experiments", symlinks=True)
        (folder / "experiments").mkdir(exist_ok=True)
        if (ROOT / "data").is_dir():
            shutil.copytree(ROOT / "data", folder / "data")
        if (ROOT / "scripts").is_dir():
            (folder / "scripts").symlink_to(ROOT / "scripts")
    return folder


def environment() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"}


def script(example: Example) -> str:
    """The bash block as it runs: whole commands (continuations joined), ``.venv/bin/`` dropped, the
    ``run with`` arguments added to each ``lmlab run``."""
    commands, current = [], ""
    for line in example.text.split("\n"):
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        commands.append(current)
        current = ""
    if current:
        commands.append(current)
    out = []
    for command in commands:
        command = re.sub(r"(^|[\s;&|(])\.venv/bin/", r"\1", command)
        if example.run_with and re.search(r"(^|[\s;&|(])lmlab run\b", command):
            code, hashed, comment = command.partition(" #")
            command = f"{code.rstrip()} {example.run_with}" + (f"  #{comment}" if hashed else "")
        out.append(command)
    if example.exit:  # the last command may fail, with that status
        last = max(i for i, c in enumerate(out) if c.strip() and not c.lstrip().startswith("#"))
        out[last:last + 1] = ["set +e", out[last], "exit $?"]
    return "set -euo pipefail\n" + "\n".join(out) + "\n"


def whole_manifest(text: str) -> str:
    """A part of a manifest made whole: a name and the quickstart's data where the part has none."""
    top = text.split("\n[")[0] if not text.startswith("[") else ""
    name = "" if re.search(r"^name\s*=", top, re.M) else 'name = "doc-example"\n'
    data = "" if re.search(r"^\[data[].]", text, re.M) else \
        '\n[data]\nuse = "text-file"\npath = "../data/tinyshakespeare.txt"\n'
    return name + text + "\n" + data


def line_pattern(expected: str) -> re.Pattern:
    parts = []
    for dots, number, space, char in TOKEN.findall(expected.strip()):
        parts.append(".*?" if dots else NUMBER if number else r"\s+" if space else re.escape(char))
    return re.compile("".join(parts))


def unmatched_output(expected: str, actual: str) -> str | None:
    """The first quoted line not found (in order) in what was printed, or None."""
    printed = actual.split("\n")
    at = 0
    for wanted in (l for l in expected.split("\n") if l.strip() and l.strip() != "..."):
        pattern = line_pattern(wanted)
        hit = next((i for i in range(at, len(printed)) if pattern.search(printed[i])), None)
        if hit is None:
            return wanted
        at = hit + 1
    return None


def run(example: Example, folder: Path, timeout: float = 900) -> None:
    """Run one example in its page's folder; AssertionError naming the page and line if it fails."""
    folder = sandbox(folder)
    if example.setup:
        setup = Example(example.page, example.line, "bash", None, example.setup)
        done = subprocess.run(["bash", "-c", script(setup)], cwd=folder, env=environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        assert done.returncode == 0, f"{example.where}: its setup failed ({done.returncode})\n{done.stdout[-3000:]}"
    if example.file:
        target = folder / example.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(example.text + "\n")
        return
    if example.lang == "bash":
        argv = ["bash", "-c", script(example)]
    elif example.lang == "toml":
        # beside the shipped manifests, so that their ../data/ paths hold
        manifest = folder / "experiments" / f"example-{example.page.stem}-{example.line}.toml"
        manifest.write_text(whole_manifest(example.text))
        argv = [sys.executable, "-m", "lmlab", "check", str(manifest.relative_to(folder))]
    else:
        argv = [sys.executable, "-c", example.text]
    done = subprocess.run(argv, cwd=folder, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    printed = done.stdout
    assert done.returncode == example.exit, (
        f"{example.where}: exit status {done.returncode}, the page expects {example.exit}\n{printed[-3000:]}")
    if example.output is not None:
        missing = unmatched_output(example.output, printed)
        assert missing is None, f"{example.where}: the page quotes {missing.strip()!r}, not printed:\n{printed[-3000:]}"
