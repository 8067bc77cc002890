"""Bringing TransferQueue up in this process: the import, torch's thread count, Ray, start and stop.

Sized for small machines (tests, a laptop, a 2-core CI box), where TransferQueue's defaults block
or fight the trainer for threads (docs/transferqueue.md says how it is started and stopped).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from sessions.errors import ConfigError, LedgerError, MissingDependency

log = logging.getLogger(__name__)

__all__ = [
    "RAY_LOOPBACK_ENV",
    "TQ_VERSION",
    "TransferQueueHandle",
    "TransferQueueStartError",
    "import_transfer_queue",
    "set_tq_num_threads",
    "start_transferqueue",
]

#: the TransferQueue release this adapter is written and tested against (pyproject's extra pins it)
TQ_VERSION = "0.1.11"

#: environment Ray and TransferQueue read at start-up (see ``start_transferqueue``)
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class TransferQueueStartError(LedgerError, RuntimeError):
    """``start_transferqueue`` could not bring TransferQueue up (nothing it started is left running)."""


def set_tq_num_threads() -> str:
    """Default ``TQ_NUM_THREADS`` to this process's torch thread count; returns the value in force.

    TransferQueue sets ``torch.set_num_threads(TQ_NUM_THREADS)`` (default 8, capped at the physical
    cores, with a warning each time it caps) around every put and get, in the client and in each
    storage unit, then restores the count it saw at import. With ``TQ_NUM_THREADS`` equal to the
    current count that dance is a no-op. TransferQueue reads the variable once, when
    ``transfer_queue`` is imported in the driver (Ray ships its actor classes from there), so this
    must run before anything imports ``transfer_queue``; a value already set is kept.
    """
    if "TQ_NUM_THREADS" not in os.environ:
        if "transfer_queue" in sys.modules:
            log.warning(
                "transfer_queue was imported before TQ_NUM_THREADS was set: TransferQueue will set torch's "
                "thread count to 8 (capped at the physical cores) around every put and get; set TQ_NUM_THREADS "
                "before importing transfer_queue"
            )
        import torch

        os.environ["TQ_NUM_THREADS"] = str(max(1, torch.get_num_threads()))
    return os.environ["TQ_NUM_THREADS"]


def import_transfer_queue() -> ModuleType:
    """``import transfer_queue`` after ``set_tq_num_threads()``, with a clear error without the extra."""
    set_tq_num_threads()
    try:
        import transfer_queue
    except ImportError as error:
        raise MissingDependency(
            "the TransferQueue adapter needs the optional extra: pip install -e '.[transferqueue]' in the clone "
            f"(TransferQueue=={TQ_VERSION}, import name transfer_queue)"
        ) from error
    return transfer_queue


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class TransferQueueHandle:
    """What ``start_transferqueue`` started; ``close()`` (or leaving the ``with``) stops exactly that."""

    config: Any
    ray_cpus: int
    storage_units: int
    started_ray: bool
    startup_s: float
    _env_before: dict[str, str | None] = field(default_factory=dict, repr=False)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """``tq.close()``, then ``ray.shutdown()`` if this handle started Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            import_transfer_queue().close()
        finally:
            try:
                if self.started_ray:
                    import ray

                    ray.shutdown()
            finally:
                _restore_env(self._env_before)

    def __enter__(self) -> TransferQueueHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _restore_env(before: Mapping[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def start_transferqueue(
    *,
    num_cpus: int | None = None,
    storage_units: int | None = None,
    timeout_s: float = 120.0,
    config: Mapping[str, Any] | None = None,
    ray_init_kwargs: Mapping[str, Any] | None = None,
) -> TransferQueueHandle:
    """Start Ray (unless this process already joined one) and a TransferQueue in it.

    * Binds Ray to loopback and turns usage stats off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
      ``RAY_USAGE_STATS_ENABLED=0``; restored on close) and sets ``TQ_NUM_THREADS`` (see
      ``import_transfer_queue``) before Ray's processes start, so they inherit it.
    * ``ray.init(address="local", num_cpus=..., include_dashboard=False)``: a new local instance,
      never someone else's cluster. ``num_cpus`` defaults to the CPUs this process may use (at
      least 2). The controller and each storage unit reserve one Ray CPU, and TransferQueue's
      default of 2 storage units blocks ``tq.init`` forever on a 2-CPU machine, so
      ``storage_units`` defaults to ``min(2, ray_cpus - 1)``: one on 2 cores. More than fit is a
      ``ValueError`` before anything starts.
    * ``tq.init`` runs under ``timeout_s``; if it blocks, what was started is shut down and
      ``TransferQueueStartError`` says why.
    * ``config`` is merged into TransferQueue's (e.g. ``{"controller": {"polling_mode": True}}``).

    If Ray is already initialised in this process, it is used (and left running on close); a
    TransferQueue controller already running there is refused: attach to it with
    ``transfer_queue.init()`` instead — this handle only stops what it started.
    """
    env_before = {name: os.environ.get(name) for name in RAY_LOOPBACK_ENV}
    os.environ.update(RAY_LOOPBACK_ENV)
    started = time.monotonic()
    try:
        tq = import_transfer_queue()
        import ray
    except BaseException:
        _restore_env(env_before)
        raise

    started_ray = False
    try:
        if ray.is_initialized():
            ray_cpus = int(ray.available_resources().get("CPU", 0))
            try:
                ray.get_actor("TransferQueueController", namespace="transfer_queue")
            except ValueError:
                pass
            else:
                raise TransferQueueStartError(
                    "a TransferQueue controller already runs in this Ray cluster; attach with "
                    "transfer_queue.init() and pass TransferQueueSink() to the ledger — start_transferqueue "
                    "only starts (and stops) a TransferQueue of its own"
                )
        else:
            ray_cpus = max(2, int(num_cpus) if num_cpus is not None else _available_cpus())
        units = min(2, ray_cpus - 1) if storage_units is None else int(storage_units)
        if units < 1 or units + 1 > ray_cpus:
            raise ConfigError(
                f"TransferQueue needs one Ray CPU for its controller and one per storage unit: "
                f"{units} storage unit(s) need {units + 1} CPUs, Ray has {ray_cpus}"
                + (" available" if ray.is_initialized() else "")
                + "; tq.init would block forever. Use fewer storage units or more num_cpus."
            )
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "address": "local",
                "num_cpus": ray_cpus,
                "include_dashboard": False,
            }
            kwargs.update(ray_init_kwargs or {})
            ray.init(**kwargs)
            started_ray = True

        conf: dict[str, Any] = {"backend": {"SimpleStorage": {"num_data_storage_units": units}}}
        if config:
            from omegaconf import OmegaConf

            conf = OmegaConf.to_container(
                OmegaConf.merge(OmegaConf.create(conf), OmegaConf.create(dict(config)))
            )  # type: ignore[assignment]
        final = _init_with_timeout(tq, conf, timeout_s, ray_cpus, units)
    except BaseException:
        try:
            if started_ray:
                try:
                    tq.close()
                finally:
                    ray.shutdown()
        finally:
            _restore_env(env_before)
        raise
    return TransferQueueHandle(
        config=final,
        ray_cpus=ray_cpus,
        storage_units=units,
        started_ray=started_ray,
        startup_s=time.monotonic() - started,
        _env_before=env_before,
    )


def _init_with_timeout(
    tq: ModuleType, conf: Mapping[str, Any], timeout_s: float, ray_cpus: int, units: int
) -> Any:
    """``tq.init(conf)`` in a daemon thread, so a blocked start-up becomes an error, not a hang."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["config"] = tq.init(conf)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="transferqueue-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TransferQueueStartError(
            f"transfer_queue.init did not return within {timeout_s}s (Ray CPUs: {ray_cpus}, storage units: "
            f"{units}). It blocks when Ray cannot place the controller and storage-unit actors (one CPU "
            "each) — another job may hold Ray's CPUs — or when an actor fails to start; see the Ray logs."
        )
    if "error" in outcome:
        raise TransferQueueStartError(
            f"transfer_queue.init failed: {outcome['error']}"
        ) from outcome["error"]
    return outcome.get("config")
