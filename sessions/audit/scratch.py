"""Where the audit's fold puts the read models of finished steps: a scratch SQLite file.

The fold of a whole log holds its read models in memory, O(sessions): about 4 KB a session, so
884 MB at 200k sessions (issue 28). Past a bound, the audit moves the rows of steps that look done
(`Rebuild.evict_closed`) into a migrated scratch SQLite file, part by part, and compares that
file with the stored read models as two key-ordered streams (`read_model_diff.compare`), so its
memory is the bound plus one chunk per side. The file lives in a temporary folder removed on close.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sessions.audit.replay import prepare
from sessions.projection.rebuild import ReadModels
from store import AsyncEngine, create_engine, driver, upgrade
from store import bulk_read_models as bulk

__all__ = ["Scratch"]


class Scratch:
    """A scratch ledger file that rebuilt rows are added to; `engine` reads it back."""

    def __init__(self, source: AsyncEngine) -> None:
        self._source = source
        self._folder = Path(tempfile.mkdtemp(prefix="rollout-ledger-audit-"))
        self.engine: AsyncEngine = create_engine(f"sqlite+aiosqlite:///{self._folder / 'fold.db'}")
        self._ready = False

    async def add(self, models: ReadModels) -> None:
        """Add rebuilt rows (queue rows keep their ids), in one transaction."""
        if not self._ready:
            await upgrade(self.engine)
            self._ready = True
        rows = prepare(models, self._source, self.engine)
        async with driver.writer(self.engine) as write:
            await bulk.add_read_model_rows(write, rows)
            await write.commit()

    async def drop_queue_rows(self, steps: set[tuple[str, str, int]]) -> None:
        """Drop the queue rows of pruned steps, as their prune did."""
        if steps and self._ready:
            async with driver.writer(self.engine) as write:
                await bulk.drop_queue_rows_of_steps(write, sorted(steps))
                await write.commit()

    async def close(self) -> None:
        await self.engine.dispose()
        shutil.rmtree(self._folder, ignore_errors=True)
