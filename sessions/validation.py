"""Input checks at the edge: reject bad identifiers, tokens, masks and rewards before any write."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from sessions import tokens, vocabulary
from sessions.errors import InvalidArgument, InvalidArgumentType, InvalidInput
from sessions.tokens import TokenArrays

__all__ = [
    "TOKEN_LIMIT",
    "check_identity",
    "count",
    "flag",
    "label",
    "latency",
    "read_step",
    "seconds",
    "json_dict",
    "reward",
    "token_array",
    "trajectory",
    "trajectory_payload",
    "version",
    "versions",
]

TOKEN_LIMIT = 2**31


def check_identity(
    session_id: str,
    *,
    run: str,
    uid: str,
    session_index: int,
    group_size: int,
    partition: str,
    global_step: int | None,
) -> None:
    """A new session's identity: its names by the vocabulary's rules, its numbers checked here."""
    vocabulary.check_session_id(session_id)
    vocabulary.check_run(run, session_id=session_id)
    vocabulary.check_uid(uid, session_id=session_id)
    if not _is_int(group_size) or group_size < 1:
        raise InvalidInput(session_id, "group_size", f"must be an integer >= 1, got {group_size!r}")
    if not _is_int(session_index) or not 0 <= session_index < group_size:
        raise InvalidInput(
            session_id,
            "session_index",
            f"must be an integer in [0, group_size={group_size}), got {session_index!r}",
        )
    vocabulary.check_partition(partition, session_id=session_id)
    if global_step is not None and (not _is_int(global_step) or global_step < 0):
        raise InvalidInput(
            session_id, "global_step", f"must be an integer >= 0 or None, got {global_step!r}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def token_array(session_id: str, field: str, values: Any) -> np.ndarray:
    """A 1-D int32 array of token ids in [0, 2**31); non-empty."""
    array = _as_1d(session_id, field, values)
    if array.size == 0:
        raise InvalidInput(
            session_id,
            field,
            "is empty; a trajectory needs at least one prompt and one response token",
        )
    if array.dtype.kind not in "iu":
        if (
            array.dtype.kind == "f"
            and np.all(np.isfinite(array))
            and np.all(array == np.floor(array))
        ):
            wide = array.astype(np.float64)  # float16 cannot hold 2**31 to compare with
            outside = wide[(wide < 0) | (wide >= TOKEN_LIMIT)]
            if outside.size:  # named as given: the cast below would wrap it first
                raise InvalidInput(
                    session_id, field, f"token id {outside[0]:g} is outside [0, 2**31)"
                )
            array = array.astype(np.int64)
        else:
            raise InvalidInput(
                session_id, field, f"must hold integer token ids, got dtype {array.dtype}"
            )
    if not _in_token_range(array):
        low, high = int(array.min()), int(array.max())
        bad = low if low < 0 else high
        raise InvalidInput(session_id, field, f"token id {bad} is outside [0, 2**31)")
    return array.astype("<i4", copy=False)


def _in_token_range(array: np.ndarray) -> bool:
    """All ids in [0, 2**31), in one pass: read as unsigned, a negative id is a huge one."""
    if array.dtype.kind == "i" and array.dtype.itemsize in (4, 8) and array.dtype.isnative:
        unsigned = np.uint32 if array.dtype.itemsize == 4 else np.uint64
        return int(array.view(unsigned).max()) < TOKEN_LIMIT
    return int(array.min()) >= 0 and int(array.max()) < TOKEN_LIMIT


def _mask_array(session_id: str, values: Any, length: int) -> np.ndarray:
    array = _as_1d(session_id, "response_mask", values)
    if array.shape[0] != length:
        raise InvalidInput(
            session_id,
            "response_mask",
            f"has length {array.shape[0]} but response_ids has {length}",
        )
    if array.dtype == np.bool_:
        return array.astype(np.uint8)
    if not np.all((array == 0) | (array == 1)):
        bad = array[(array != 0) & (array != 1)][0]
        raise InvalidInput(session_id, "response_mask", f"values must be 0 or 1, found {bad!r}")
    return array.astype(np.uint8)


def _logprob_array(session_id: str, values: Any, length: int) -> np.ndarray:
    array = _as_1d(session_id, "response_logprobs", values)
    if array.dtype.kind not in "fiu":
        raise InvalidInput(
            session_id, "response_logprobs", f"must hold numbers, got dtype {array.dtype}"
        )
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, refused just below
        array = array.astype(np.float32)
    if array.shape[0] != length:
        raise InvalidInput(
            session_id,
            "response_logprobs",
            f"has length {array.shape[0]} but response_ids has {length}",
        )
    if not np.all(np.isfinite(array)):
        raise InvalidInput(session_id, "response_logprobs", "holds NaN or infinite values")
    return array


def trajectory(
    session_id: str,
    prompt_ids: Any,
    response_ids: Any,
    response_mask: Any | None,
    response_logprobs: Any | None,
) -> TokenArrays:
    prompt = token_array(session_id, "prompt_ids", prompt_ids)
    response = token_array(session_id, "response_ids", response_ids)
    if response_mask is None:
        mask = np.ones(response.shape[0], dtype=np.uint8)
    else:
        mask = _mask_array(session_id, response_mask, response.shape[0])
    logprobs = (
        None
        if response_logprobs is None
        else _logprob_array(session_id, response_logprobs, response.shape[0])
    )
    return TokenArrays(prompt, response, mask, logprobs)


#: Token id arrays the fast path of `trajectory_payload` takes as they are: native int32 and
#: int64, each with the unsigned type a range check reads it as.
_UNSIGNED = {np.dtype("<i4"): np.dtype("<u4"), np.dtype("<i8"): np.dtype("<u8")}
_max = np.maximum.reduce


def trajectory_payload(
    session_id: str,
    prompt_ids: Any,
    response_ids: Any,
    response_mask: Any | None,
    response_logprobs: Any | None,
) -> tuple[bytes, int, int, bool, int]:
    """A trajectory checked as `trajectory` checks it and encoded as `tokens.encode` lays it out:
    (payload, prompt_len, response_len, has_logprobs, trainable_tokens).

    The usual input — two 1-D native int32 or int64 numpy arrays, no mask — is checked and laid
    out in one concatenation and one range check, the mask of ones written as bytes; anything
    else (lists, tensors, other dtypes, any id out of range) goes through `trajectory`, which
    also words the problem."""
    ids = None
    if type(prompt_ids) is np.ndarray and type(response_ids) is np.ndarray:
        unsigned = _UNSIGNED.get(prompt_ids.dtype)
        if (
            unsigned is not None
            and prompt_ids.dtype == response_ids.dtype
            and prompt_ids.ndim == 1
            and response_ids.ndim == 1
            and prompt_ids.shape[0]
            and response_ids.shape[0]
        ):
            ids = np.concatenate((prompt_ids, response_ids))
            if int(_max(ids.view(unsigned))) >= TOKEN_LIMIT:
                ids = None  # the full check below names the id
    if ids is None:
        arrays = trajectory(session_id, prompt_ids, response_ids, response_mask, response_logprobs)
        trainable = (
            arrays.response_len if response_mask is None else int(arrays.response_mask.sum())
        )
        has_logprobs = arrays.logprobs is not None
        return (
            tokens.encode(arrays),
            arrays.prompt_len,
            arrays.response_len,
            has_logprobs,
            trainable,
        )
    prompt_len, response_len = prompt_ids.shape[0], response_ids.shape[0]
    if response_mask is None:
        trainable, mask = response_len, b"\x01" * response_len
    else:
        checked = _mask_array(session_id, response_mask, response_len)
        trainable, mask = int(checked.sum()), checked.tobytes()
    parts = [ids.astype(tokens.INT32, copy=False).tobytes()]
    if response_logprobs is not None:
        parts.append(_logprob_array(session_id, response_logprobs, response_len).tobytes())
    parts.append(mask)
    return b"".join(parts), prompt_len, response_len, response_logprobs is not None, trainable


def reward(session_id: str, field: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidInput(
            session_id,
            field,
            f"must be a finite number or None, got {type(value).__name__} {value!r}",
        )
    try:
        number = float(value)
    except OverflowError:
        raise InvalidInput(
            session_id, field, f"must be finite, got an integer of {len(str(value))} digits"
        ) from None
    if not math.isfinite(number):
        raise InvalidInput(session_id, field, f"must be finite, got {number}")
    return number


def label(session_id: str, field: str, value: Any) -> str:
    """An id given by the caller (a model call's): a non-empty string; its length and characters
    are the declaration's to check (`sessions.storable`)."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(session_id, field, f"must be a non-empty string, got {value!r:.60}")
    return value


def count(session_id: str, field: str, value: Any) -> int:
    """An integer >= 0 (a turn index)."""
    if isinstance(value, (bool, np.bool_)) or not _is_int(value) or value < 0:
        raise InvalidInput(session_id, field, f"must be an integer >= 0, got {value!r:.60}")
    return int(value)


def version(session_id: str, field: str, value: Any) -> int | None:
    """A weights version (verl's `global_steps`): an integer >= 0, or None when unknown."""
    return None if value is None else count(session_id, field, value)


def versions(session_id: str, low: Any, high: Any) -> tuple[int | None, int | None]:
    """The lowest and highest weights version behind a response; one given stands for both."""
    low, high = version(session_id, "min_version", low), version(session_id, "max_version", high)
    low = high if low is None else low
    high = low if high is None else high
    if low is not None and high is not None and low > high:
        raise InvalidInput(
            session_id, "min_version", f"is {low}, above max_version {high}; pass them in order"
        )
    return low, high


def latency(session_id: str, value: Any) -> float | None:
    """A call's duration in seconds: finite and >= 0, or None when not measured."""
    if value is None:
        return None
    number = reward(session_id, "latency_s", value)
    if number is None or number < 0:
        raise InvalidInput(session_id, "latency_s", f"must be >= 0 seconds, got {value!r}")
    return number


def flag(value: object, name: str) -> bool:
    """An on/off option as a bool (True/False, numpy's, or 0/1): anything else is refused, since
    a list or an array given by mistake would pass or fail on its truth value."""
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, (int, np.integer)) and value in (0, 1)
    ):
        return bool(value)
    raise InvalidArgumentType(f"{name} must be True or False, got {value!r}", argument=name)


#: The largest step the events table's BIGINT column holds: no recorded session is beyond it.
_MAX_STEP = 2**63 - 1


def read_step(global_step: object) -> int | None:
    """A step a read asks for, as the query binds it (a numpy integer becomes an int), or a
    refusal before any query: sessions are recorded with an integer step >= 0, or none."""
    if global_step is None:
        return None
    if (
        isinstance(global_step, (bool, np.bool_))
        or not isinstance(global_step, numbers.Integral)
        or not 0 <= global_step <= _MAX_STEP
    ):
        raise InvalidArgument(
            f"global_step must be an integer in [0, 2**63 - 1] (what the log stores) or None "
            f"(sessions recorded without a step), "
            f"got {global_step!r}",
            argument="global_step",
        )
    return int(global_step)


def seconds(value: object, name: str, *, forever: bool = False) -> float | None:
    """A duration option (a timeout, a poll interval) as a number the call can count down, or
    a refusal: NaN would never run out. `forever`: None means "no bound"."""
    if value is None and forever:
        return None
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or math.isnan(value)
    ):
        raise InvalidArgument(
            f"{name} must be a number of seconds"
            + (" or None (no bound)" if forever else "")
            + f", got {value!r}",
            argument=name,
        )
    return float(value)


def json_dict(session_id: str, field: str, value: Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON-serialisable dict with finite numbers (JSON has no NaN)."""
    import json

    if value is None or (type(value) is dict and not value):
        return {}
    if not isinstance(value, Mapping):
        raise InvalidInput(session_id, field, f"must be a mapping, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidInput(
            session_id, field, f"must be JSON-serialisable with finite numbers: {error}"
        ) from None
    return dict(value)


def _as_1d(session_id: str, field: str, values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, of any dtype, on any device
        values = _tensor_to_numpy(session_id, field, values)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise InvalidInput(session_id, field, f"cannot be read as an array: {error}") from None
    if array.ndim != 1:
        raise InvalidInput(session_id, field, f"must be 1-D, got shape {tuple(array.shape)}")
    if array.dtype == object:
        raise InvalidInput(session_id, field, "must hold numbers only")
    return array


def _tensor_to_numpy(session_id: str, field: str, tensor: Any) -> np.ndarray:
    """A tensor's values as numpy, whatever its device and dtype (bfloat16 and float16 have no
    numpy twin: widened to float32, exactly). A meta tensor has no values to record."""
    if getattr(tensor, "is_meta", False) or str(getattr(tensor, "device", "")) == "meta":
        raise InvalidInput(
            session_id,
            field,
            "is a tensor on the 'meta' device, which holds no values; pass real values (e.g. .to('cpu') after filling it)",
        )
    tensor = tensor.detach()
    if tensor.is_complex():
        raise InvalidInput(
            session_id, field, f"must hold real numbers, got a {tensor.dtype} tensor"
        )
    if str(tensor.dtype) in ("torch.bfloat16", "torch.float16") or "float8" in str(tensor.dtype):
        tensor = tensor.float()
    try:
        return tensor.cpu().numpy()
    except (TypeError, RuntimeError) as error:
        raise InvalidInput(
            session_id,
            field,
            f"cannot be read as numbers ({tensor.dtype} on {tensor.device}): {error}",
        ) from None
