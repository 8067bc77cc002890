"""The OpenAI wire format as vLLM's server speaks it: what the gateway adds to a request so the
server returns token ids and log-probs, what it reads back (whole or streamed), and what it
removes again so the agent sees the answer it asked for (docs/gateway.md).

Sent to the server, beside the agent's own fields:

- `return_token_ids: true` — vLLM (>= 0.10.2) answers with `prompt_token_ids` (on the response
  for chat, on the choice for completions; in the first chunk when streaming) and each choice's
  `token_ids` (the delta's tokens when streaming).
- `logprobs` — `true` for chat, `0` for completions (the sampled token's log-prob only), unless
  the agent asked for more; each answer token's log-prob comes from there.
- `return_tokens_as_token_ids: true` when the agent did not ask for log-probs itself: the
  log-prob entries then name their tokens `token_id:<id>`, so a server without
  `return_token_ids` still gives the answer's ids. (Not when the agent asked: its entries would
  change under it.)

Nothing is re-tokenized: a call whose prompt or answer ids the server did not give is `missing`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = [
    "Asked",
    "Capture",
    "Endpoint",
    "asked_for",
    "dumps",
    "for_upstream",
    "loads",
    "sampling_of",
    "visible",
    "weights_version",
]

Endpoint = Literal["chat", "completion"]
_TOKEN_ID_PREFIX = "token_id:"
#: What a call's intent keeps of the request (`sampling`): the knobs, never the messages.
_SAMPLING_KEYS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "stream",
)


@dataclass(frozen=True, slots=True)
class Asked:
    """What the agent itself asked for, so the gateway's additions can be taken out again."""

    logprobs: bool
    token_ids: bool
    tokens_as_ids: bool


def asked_for(body: dict[str, Any]) -> Asked:
    logprobs = body.get("logprobs")
    return Asked(
        logprobs=logprobs is not None and logprobs is not False,
        token_ids=bool(body.get("return_token_ids")),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
    )


def for_upstream(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The request the server gets: the agent's body with the token options added."""
    asked = asked_for(body)
    sent = dict(body)
    sent["return_token_ids"] = True
    if not asked.logprobs:
        sent["logprobs"] = True if endpoint == "chat" else 0
        sent["return_tokens_as_token_ids"] = True
    return sent


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling knobs, as the call's intent records them."""
    return {key: body[key] for key in _SAMPLING_KEYS if key in body}


def weights_version(
    headers: Any, body: dict[str, Any] | None, header: str | None, body_field: str | None
) -> int | None:
    """The weights version the server says served the call: a header, else a top-level field
    (each configurable; None when the server sends neither or something not an integer)."""
    raw: Any = None
    if header:
        raw = headers.get(header)
    if raw is None and body_field and body is not None:
        raw = body.get(body_field)
    if raw is None or isinstance(raw, bool):
        return None
    try:
        version = int(raw)
    except (TypeError, ValueError):
        return None
    return version if 0 <= version < 2**63 else None


def _ids(values: Any) -> list[int] | None:
    """`values` if it is a list of integers (no bools), else None. The types are collected in
    C (`set(map(type, ...))`): a prompt's ids are thousands of them on every call."""
    if not isinstance(values, list) or not set(map(type, values)) <= {int}:
        return None
    return values


@dataclass(slots=True)
class Capture:
    """What one call's answer carries for the ledger, gathered from one response or the chunks of
    a stream (choice 0; the gateway refuses `n` > 1)."""

    endpoint: Endpoint
    prompt_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    saw_token_ids: bool = False
    logprobs: list[float] = field(default_factory=list)
    logprob_tokens: list[str] = field(default_factory=list)
    logprobs_complete: bool = True
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    version: int | None = None

    def take(self, payload: dict[str, Any]) -> None:
        """Read one response, or one chunk of a stream."""
        prompt = _ids(payload.get("prompt_token_ids"))
        if prompt is not None and self.prompt_ids is None:
            self.prompt_ids = prompt
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._take_choice(choice)

    def _take_choice(self, choice: dict[str, Any]) -> None:
        prompt = _ids(choice.get("prompt_token_ids"))
        if prompt is not None and self.prompt_ids is None:
            self.prompt_ids = prompt
        ids = _ids(choice.get("token_ids"))
        if ids is not None:
            self.token_ids.extend(ids)
            self.saw_token_ids = True
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        message = choice.get("message") or choice.get("delta")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            self.text.append(message["content"])
        elif isinstance(choice.get("text"), str):
            self.text.append(choice["text"])
        self._take_logprobs(choice.get("logprobs"))

    def _take_logprobs(self, logprobs: Any) -> None:
        if logprobs is None:
            return
        if not isinstance(logprobs, dict):
            self.logprobs_complete = False
            return
        if self.endpoint == "chat":
            entries = logprobs.get("content") or []
            pairs = [(e.get("token"), e.get("logprob")) for e in entries if isinstance(e, dict)]
            if len(pairs) != len(entries):
                self.logprobs_complete = False
        else:
            pairs = list(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))
        for token, value in pairs:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.logprobs.append(float(value))
            else:
                self.logprobs_complete = False
            self.logprob_tokens.append(token if isinstance(token, str) else "")

    def response_ids(self) -> list[int] | None:
        """The answer's token ids: `token_ids`, else the `token_id:<id>` names of its log-probs."""
        if self.saw_token_ids:
            return self.token_ids or None
        ids: list[int] = []
        for token in self.logprob_tokens:
            if not token.startswith(_TOKEN_ID_PREFIX):
                return None
            try:
                ids.append(int(token[len(_TOKEN_ID_PREFIX) :]))
            except ValueError:
                return None
        return ids or None

    def response_logprobs(self, length: int) -> list[float] | None:
        """One log-prob per answer token, or None (never a partial list)."""
        if self.logprobs_complete and len(self.logprobs) == length:
            return self.logprobs
        return None

    def missing(self) -> str | None:
        """Why this call cannot train (None when it can): the ids the server did not give."""
        lost = [
            what
            for what, ids in (("prompt", self.prompt_ids), ("answer", self.response_ids()))
            if not ids
        ]
        if not lost:
            return None
        return f"the server gave no {' and no '.join(lost)} token ids"


def visible(payload: dict[str, Any], asked: Asked) -> dict[str, Any]:
    """The response (or chunk) as the agent asked for it: the gateway's additions removed."""
    if not asked.token_ids:
        payload.pop("prompt_token_ids", None)
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if not asked.token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            if not asked.logprobs and "logprobs" in choice:
                choice["logprobs"] = None
    return payload


#: An integer literal beyond 64 bits has 19 digits or more; orjson reads one as a float, so a body
#: with such a run of digits goes to the stdlib (as `store.stored_json` does).
_LONG_DIGITS = re.compile(rb"[0-9]{19}").search


def loads(raw: bytes) -> Any:
    """`json.loads(raw)`, by orjson (several times faster on a response full of token ids)
    wherever the two read the same: what orjson refuses (NaN, a lone surrogate, a body not in
    UTF-8) or would read differently (an integer beyond 64 bits) goes to the stdlib, which
    raises its own errors for what is not JSON."""
    if _LONG_DIGITS(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
