"""Stored text as a person may see it: every control character written as an escape.

Ids, messages and metric names are user data. A raw ESC or BEL in a terminal, C1 controls in an
HTML page, or a bidi override (U+202E) that visually reorders an id would each show something
other than what is stored; the terminal verbs, the HTML report and the tracker summaries all show
text through `visible` so the three agree (docs/design.md §11).
"""

from __future__ import annotations

__all__ = ["cut", "visible"]

_VISIBLE = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def visible(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\x1b`, `\\u2028`…)."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            code = ord(ch)
            out.append(
                f"\\x{code:02x}"
                if code < 0x100
                else f"\\u{code:04x}"
                if code < 0x10000
                else f"\\U{code:08x}"
            )
    return "".join(out)


def cut(text: str, limit: int = 200) -> str:
    """`text` shortened to `limit` characters with an explicit `… (+N chars)` marker."""
    return text if len(text) <= limit else f"{text[:limit]}… (+{len(text) - limit} chars)"
