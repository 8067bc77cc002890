"""Token arrays <-> the binary payload column.

Layout (little-endian, every array 4-byte aligned except the trailing mask):
prompt_ids int32[P] | response_ids int32[R] | logprobs float32[R] (if any) | response_mask uint8[R].
Lengths live in the event's JSON data, so the payload is just the arrays: JSON token lists are
~5x larger and dominate decode time (docs/design.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sessions.errors import DamagedData

__all__ = [
    "INT32",
    "TokenArrays",
    "decode",
    "encode",
    "payload_size",
]

INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
_MASK = np.dtype("u1")


@dataclass(frozen=True, slots=True)
class TokenArrays:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray | None

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])


def encode(arrays: TokenArrays) -> bytes:
    parts = [
        arrays.prompt_ids.astype(INT32, copy=False).tobytes(),
        arrays.response_ids.astype(INT32, copy=False).tobytes(),
    ]
    if arrays.logprobs is not None:
        parts.append(arrays.logprobs.astype(_FLOAT32, copy=False).tobytes())
    parts.append(arrays.response_mask.astype(_MASK, copy=False).tobytes())
    return b"".join(parts)


def payload_size(prompt_len: int, response_len: int, has_logprobs: bool) -> int:
    return (
        4 * prompt_len + 4 * response_len + (4 * response_len if has_logprobs else 0) + response_len
    )


def decode(payload: bytes, prompt_len: int, response_len: int, has_logprobs: bool) -> TokenArrays:
    """Zero-copy views over the payload; raises ValueError if the sizes disagree."""
    expected = payload_size(prompt_len, response_len, has_logprobs)
    if len(payload) != expected:
        raise DamagedData(
            f"token payload is {len(payload)} bytes but prompt_len={prompt_len}, response_len={response_len}, "
            f"logprobs={has_logprobs} need {expected}"
        )
    offset = 0
    prompt = np.frombuffer(payload, INT32, prompt_len, offset)
    offset += 4 * prompt_len
    response = np.frombuffer(payload, INT32, response_len, offset)
    offset += 4 * response_len
    logprobs = None
    if has_logprobs:
        logprobs = np.frombuffer(payload, _FLOAT32, response_len, offset)
        offset += 4 * response_len
    mask = np.frombuffer(payload, _MASK, response_len, offset)
    return TokenArrays(prompt, response, mask, logprobs)
