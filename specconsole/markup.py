"""Text and figures from data, made safe where they become Markdown or HTML.

Prompts, model output, errors, category and engine names come from users, uploaded suites and history files that
may have been shared or edited; a history's figures are JSON that may hold anything. They are shown as text, never
as markup: md() for Markdown, html.escape for HTML text, and number() for a figure in either.
"""

from __future__ import annotations

import html
import logging
import numbers
import string

log = logging.getLogger(__name__)

# CommonMark lets a backslash escape any ASCII punctuation; the HTML-special ones become entities instead, so the text
# is inert both to the Markdown parser and to the HTML it lets through. Line breaks become spaces: a line that starts
# with '#', '-', '>' or '1.' could otherwise begin a block.
_MD = {c: "\\" + c for c in string.punctuation} | {"<": "&lt;", ">": "&gt;", "&": "&amp;", '"': "&quot;",
                                                    "'": "&#39;", "\n": " ", "\r": " "}
_MD_TABLE = str.maketrans(_MD)

NOT_A_NUMBER = "?"  # a figure in a history file that is not a number


def md(value) -> str:
    """`value` (str() of it) as literal inline Markdown text."""
    return str(value).translate(_MD_TABLE)


def number(value, spec: str = "", suffix: str = "", missing: str = "–") -> str:
    """A figure for HTML or Markdown: a real number formatted with `spec` (and our `suffix`); `missing` for None;
    NOT_A_NUMBER for anything else, whose text is never shown."""
    if value is None:
        return missing
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        log.warning("a figure that is not a number (%s) is shown as %r", type(value).__name__, NOT_A_NUMBER)
        return NOT_A_NUMBER
    return html.escape(f"{value:{spec}}{suffix}")
