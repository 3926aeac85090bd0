"""Every example in README.md and the manual runs as the page shows it (doc_examples.py says how a
page marks its examples); a page whose command, option or quoted output went stale fails here."""

from dataclasses import replace

import pytest

import doc_examples
from doc_examples import Example, examples, pages, run

# Slow: end-to-end commands (scheduled first, and left out of the quick loop's -m "not slow"). The root
# conftest.py has each page's examples run in page order by one worker; pages run side by side.
RUN = [pytest.param(e, id=e.id, marks=pytest.mark.slow) for page in pages() for e in examples(page)
       if e.not_run is None]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One folder per page, shared by its examples in page order."""
    made = {}

    def folder(page):
        if page not in made:
            made[page] = tmp_path_factory.mktemp(page.stem)
        return made[page]
    return folder


@pytest.mark.parametrize("example", RUN)
def test_the_documentation_example_runs_as_the_page_shows(example, folders):
    run(example, folders(example.page))


def _page(tmp_path, text):
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_a_wrong_option_name_in_an_example_manifest_fails_naming_the_page_line_and_key(tmp_path, monkeypatch):
    monkeypatch.setattr(doc_examples, "ROOT", tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tinyshakespeare.txt").write_text("To be, or not to be: that is the question.\n" * 50)
    page = _page(tmp_path, 'Some text.\n\n```toml\n[attention]\nuse = "gqa"\nn_kv_head = 2\n```\n')
    (example,) = examples(page)
    with pytest.raises(AssertionError, match=r"(?s)page.md, line 3: exit status 2.*attention\.n_kv_head"):
        run(example, tmp_path / "folder")


def test_quoted_output_is_matched_in_order_with_any_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(doc_examples, "ROOT", tmp_path)
    page = _page(tmp_path, "```bash\nprintf 'step 10 | loss 2.51\\nstep 20 | loss 2.04\\ndone in 3.2s\\n'\n```\n\n"
                 "```\nstep 100 | loss 1.90\n...\ndone in 61 s\n```\n\n<!-- not run: needs a GPU -->\n"
                 "```bash\nexit 1\n```\n\n<!-- exit: 3 -->\n```bash\ntrue\nexit 3\n```\n")
    quoted, gpu, failing = examples(page)
    assert quoted.output is not None and gpu.not_run == "needs a GPU" and failing.exit == 3
    with pytest.raises(AssertionError, match="quotes 'done in 61 s'"):
        run(quoted, tmp_path / "folder")  # "61 s" against "3.2s": the space is part of what is quoted
    run(replace(quoted, output="step 1 | loss 9\n...\ndone in 1.5s"), tmp_path / "folder")
    run(failing, tmp_path / "folder")
    with pytest.raises(AssertionError, match="quotes 'step 3 | loss 3'"):  # three lines quoted, two printed
        run(replace(quoted, output="step 1 | loss 1\nstep 2 | loss 2\nstep 3 | loss 3"),
            tmp_path / "folder")


def test_run_with_arguments_reach_every_lmlab_run_of_the_block_and_nothing_else():
    example = Example(pages()[0], 1, "bash", None,
                      ".venv/bin/lmlab run a.toml --jobs 2   # two at once\nlmlab compare runs/a\n"
                      "lmlab run \\\n  b.toml", run_with="--set train.steps=20")
    assert doc_examples.script(example).split("\n")[1:4] == [
        "lmlab run a.toml --jobs 2 --set train.steps=20  # two at once", "lmlab compare runs/a",
        "lmlab run    b.toml --set train.steps=20"]
