"""The session state machine, defined once with `transitions` and used as a transition table.

One model-less `Machine` describes the states and commands (docs/design.md §3). Sessions do not get a
Machine each (≈1 ms and tens of KiB apiece); instead the table of (state, command) -> state is
read off the machine once, and commands validate against it before anything is appended. The
Mermaid diagram is drawn from the same machine, so the docs cannot drift from the code.
"""

from __future__ import annotations

from transitions import Machine

from sessions.errors import InvalidTransition

__all__ = [
    "COMMANDS",
    "MACHINE",
    "STATES",
    "TABLE",
    "TERMINAL_STATES",
    "allowed",
    "mermaid",
    "next_state",
]

CREATED, RUNNING, RETRYING = "created", "running", "retrying"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
STATES = [CREATED, RUNNING, RETRYING, SUCCEEDED, FAILED, CANCELLED]
TERMINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED})
COMMANDS = (
    "start",
    "start_call",
    "record_call",
    "fail_call",
    "record_trajectory",
    "post_reward",
    "complete",
    "retry",
    "fail",
    "cancel",
)

MACHINE = Machine(
    model=None,
    states=STATES,
    transitions=[
        {"trigger": "start", "source": CREATED, "dest": RUNNING},
        # Internal transitions (dest None): the session stays running. A model call is an intent
        # (start_call) then its record or its failure (docs/design.md §15).
        {"trigger": "start_call", "source": RUNNING, "dest": None},
        {"trigger": "record_call", "source": RUNNING, "dest": None},
        {"trigger": "fail_call", "source": RUNNING, "dest": None},
        {"trigger": "record_trajectory", "source": RUNNING, "dest": None},
        {"trigger": "post_reward", "source": RUNNING, "dest": None},
        {"trigger": "complete", "source": RUNNING, "dest": SUCCEEDED},
        # A failed attempt the retry policy retries: its work is superseded, the next attempt
        # starts after the backoff (a cancellation meanwhile is still a pure abort).
        {"trigger": "retry", "source": RUNNING, "dest": RETRYING},
        {"trigger": "start", "source": RETRYING, "dest": RUNNING},
        {"trigger": "fail", "source": [CREATED, RUNNING, RETRYING], "dest": FAILED},
        {"trigger": "cancel", "source": [CREATED, RUNNING, RETRYING], "dest": CANCELLED},
    ],
    initial=None,
    auto_transitions=False,
)


def _table(machine: Machine) -> dict[tuple[str, str], str]:
    table: dict[tuple[str, str], str] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            dest = transitions[0].dest
            table[(source, trigger)] = source if dest is None else dest
    return table


TABLE = _table(MACHINE)


def allowed(state: str) -> list[str]:
    return [command for command in COMMANDS if (state, command) in TABLE]


def next_state(session_id: str, state: str, command: str) -> str:
    """The state after `command`, or InvalidTransition naming session, state and command."""
    try:
        return TABLE[(state, command)]
    except KeyError:
        raise InvalidTransition(session_id, state, command, allowed(state)) from None


def mermaid() -> str:
    """The state diagram in Mermaid, drawn by transitions' own graph engine from MACHINE's table."""
    from transitions.extensions import GraphMachine

    model = type("SessionDiagram", (), {})()
    GraphMachine(
        model=model,
        states=list(MACHINE.states),
        transitions=[{"trigger": t, "source": s, "dest": d} for (s, t), d in TABLE.items()],
        initial=CREATED,
        auto_transitions=False,
        graph_engine="mermaid",
        title="rollout-ledger session",
    )
    return str(model.get_graph().draw(None))
