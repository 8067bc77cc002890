"""Draw the session state machine as an SVG, from `sessions.machine` itself (no network, no graphviz).

    python docs/make_diagram.py            # rewrites docs/state-machine.svg
    python docs/make_diagram.py --check    # exit 1 if the committed picture is not the machine's

States are laid out in columns by their longest distance from the initial state; a column's
states that are also reached from further back sit on its outside, so those longer edges go
around the states between. The machine's Mermaid text is embedded in the SVG's `<desc>`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a clone, without installing
    sys.path.insert(0, str(ROOT))

from sessions import machine  # noqa: E402

OUT = Path(__file__).resolve().parent / "state-machine.svg"
COLUMN, ROW, HEIGHT, MARGIN, CHAR = 230, 110, 38, 40, 8.4  # px; CHAR: one monospace glyph at 14px


@dataclass(frozen=True)
class Node:
    name: str
    x: float  # centre
    y: float
    width: float

    @property
    def left(self) -> float:
        return self.x - self.width / 2

    @property
    def right(self) -> float:
        return self.x + self.width / 2


def edges(table: dict[tuple[str, str], str]) -> dict[tuple[str, str], list[str]]:
    """(source, destination) -> its commands, in the machine's command order."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for command in machine.COMMANDS:
        for (source, trigger), dest in table.items():
            if trigger == command:
                found[(source, dest)].append(command)
    return dict(found)


def columns(
    states: list[str], initial: str, links: dict[tuple[str, str], list[str]]
) -> dict[str, int]:
    """Each state's column: its longest distance from the initial state, self-loops ignored."""
    depth = {initial: 0}
    for _ in states:  # relax |states| times: enough for any acyclic machine
        for source, dest in links:
            if source != dest and source in depth and depth.get(dest, -1) < depth[source] + 1:
                depth[dest] = depth[source] + 1
    return {state: depth.get(state, 0) for state in states}


def layout(
    states: list[str], initial: str, links: dict[tuple[str, str], list[str]]
) -> dict[str, Node]:
    column = columns(states, initial, links)
    width = max(len(s) for s in states) * CHAR + 28
    nodes: dict[str, Node] = {}
    for c in sorted(set(column.values())):
        members = [s for s in states if column[s] == c]
        skipped_to = [s for s in members if any(column[a] < c - 1 for (a, b) in links if b == s)]
        middle = [s for s in members if s not in skipped_to]
        order = (
            skipped_to[0::2][::-1] + middle + skipped_to[1::2]
        )  # reached from afar: top and bottom
        for row, state in enumerate(order):
            y = (row - (len(order) - 1) / 2) * ROW
            nodes[state] = Node(state, MARGIN + 60 + c * COLUMN + width / 2, y, width)
    return nodes


def _label(x: float, y: float, text: str) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" class="label">{escape(text)}</text>'


def _edge(a: Node, b: Node, commands: list[str], column_gap: int) -> list[str]:
    text = " | ".join(commands)
    if a is b:  # a self-loop over the state
        x0, x1, top = a.x - 22, a.x + 22, a.y - HEIGHT / 2
        path = f"M{x0:.1f},{top:.1f} C{x0 - 10:.1f},{top - 44:.1f} {x1 + 10:.1f},{top - 44:.1f} {x1:.1f},{top:.1f}"
        lines = [
            _label(a.x, top - 40 - 15 * i, c) for i, c in enumerate(reversed(commands))
        ]  # one a line
        return [f'<path d="{path}" class="edge"/>', *lines]
    if column_gap <= 1:  # neighbouring columns: a straight line, right side to left side
        sx, sy, tx, ty = a.right, a.y, b.left, b.y + (0 if b.y == a.y else (-6 if b.y > a.y else 6))
        return [
            f'<path d="M{sx:.1f},{sy:.1f} L{tx:.1f},{ty:.1f}" class="edge"/>',
            _label(
                (sx + tx) / 2 + (0 if ty == sy else 26 if ty > sy else -26), (sy + ty) / 2 - 7, text
            ),
        ]
    # A longer edge: out of the top (or bottom), along the destination's row, into its left side.
    sy = a.y - HEIGHT / 2 if b.y < a.y else a.y + HEIGHT / 2
    ty = b.y + (6 if b.y < a.y else -6)
    path = f"M{a.x:.1f},{sy:.1f} C{a.x:.1f},{ty:.1f} {a.x:.1f},{ty:.1f} {a.x + 50:.1f},{ty:.1f} L{b.left:.1f},{ty:.1f}"
    return [f'<path d="{path}" class="edge"/>', _label((a.x + b.left) / 2 + 25, ty - 7, text)]


def svg() -> str:
    """The SVG text, a pure function of `sessions.machine` (so the committed file can be checked)."""
    states, initial = list(machine.STATES), machine.STATES[0]
    links = edges(machine.TABLE)
    nodes = layout(states, initial, links)
    column = columns(states, initial, links)
    top = min(n.y for n in nodes.values()) - HEIGHT / 2 - MARGIN
    bottom = max(n.y for n in nodes.values()) + HEIGHT / 2 + MARGIN
    right = max(n.right for n in nodes.values()) + MARGIN
    first = nodes[initial]
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{right:.0f}" height="{bottom - top:.0f}" '
        f'viewBox="0 {top:.0f} {right:.0f} {bottom - top:.0f}" font-family="monospace" font-size="14">',
        "<title>rollout-ledger session states</title>",
        "<desc>Drawn by docs/make_diagram.py from sessions/machine.py. The machine in Mermaid:",
        f"{escape(machine.mermaid())}</desc>",
        "<style>.state{fill:#fff;stroke:#333;stroke-width:1.5}.terminal{fill:#f3f3f3;stroke:#333;stroke-width:3}"
        ".edge{fill:none;stroke:#555;stroke-width:1.3;marker-end:url(#arrow)}"
        ".label{fill:#1a4f8b;font-size:12px;text-anchor:middle}"
        ".name{text-anchor:middle;dominant-baseline:central}</style>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
        f'<circle cx="{MARGIN:.1f}" cy="{first.y:.1f}" r="8" fill="#333"/>',
        f'<path d="M{MARGIN + 8:.1f},{first.y:.1f} L{first.left:.1f},{first.y:.1f}" class="edge"/>',
    ]
    for (source, dest), commands in links.items():
        body += _edge(nodes[source], nodes[dest], commands, column[dest] - column[source])
    for node in nodes.values():
        kind = "terminal" if node.name in machine.TERMINAL_STATES else "state"
        body.append(
            f'<rect x="{node.left:.1f}" y="{node.y - HEIGHT / 2:.1f}" width="{node.width:.1f}" '
            f'height="{HEIGHT}" rx="8" class="{kind}"/>'
        )
        body.append(
            f'<text x="{node.x:.1f}" y="{node.y:.1f}" class="name">{escape(node.name)}</text>'
        )
    body.append("</svg>")
    return "\n".join(body) + "\n"


def main(argv: list[str]) -> int:
    """Write the picture, or with --check say whether the committed one is current."""
    if argv == ["--check"]:
        current = OUT.exists() and OUT.read_text(encoding="utf-8") == svg()
        print(f"{OUT.name} is {'current' if current else 'stale: run python docs/make_diagram.py'}")
        return 0 if current else 1
    OUT.write_text(svg(), encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
