"""MkDocs hook (``hooks:`` in mkdocs.yml): a fence that names a file, ```` ```python file=NAME ````, is
rendered as a fence of its language under the file's name.

The name is for the tests that run the manual's examples (tests/doc_examples.py and
tests/test_readme_plugin.py write such a block to NAME); Python-Markdown takes a fence's language alone
and would not see the block as code.
"""

import re

FILE_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<lang>[\w+-]+)[ \t]+file=(?P<name>\S+)[ \t]*$", re.M)


def on_page_markdown(markdown: str, **kwargs) -> str:
    return FILE_FENCE.sub(lambda m: f"`{m['name']}`:\n\n{m['fence']}{m['lang']}", markdown)
