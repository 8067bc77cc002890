"""metric_counts keyed by its natural key: no surrogate id, a unique index that holds for NULLs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

A replayed database must equal the live one row for row (docs/design.md §9); a surrogate id assigned in
insertion order cannot promise that. The key (run, partition, global_step, data_source, metric)
has NULLable parts ("no step", "all data sources") and unique constraints treat NULLs as
distinct, so the key is a unique index on expressions: coalesce(global_step, -1) and
coalesce(data_source, '') — values no row holds (steps are >= 0; an empty data source is refused
at append). The table is rebuilt (SQLite cannot drop a primary key in place); duplicates of a
key, which no release wrote, would keep the newest row. The views read the table, so they are
dropped first and created again after, as revision 0002 defines them.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_VIEWS = importlib.import_module("migrations.versions.0002_sql_views").VIEWS
_KEY = "run, partition, coalesce(global_step, -1), coalesce(data_source, ''), metric"
_COLUMNS = "run, partition, global_step, data_source, metric, value"


def _columns(with_id: bool) -> list[sa.Column]:
    columns = [
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("partition", sa.String(length=8), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=True),
        sa.Column("data_source", sa.String(length=128), nullable=True),
        sa.Column("metric", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
    ]
    if with_id:
        columns.insert(
            0,
            sa.Column(
                "id",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                autoincrement=True,
                nullable=False,
            ),
        )
        columns.append(sa.PrimaryKeyConstraint("id", name="pk_metric_counts"))
    return columns


def _drop_views() -> None:
    for name, _create in reversed(_VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")


def _create_views() -> None:
    for _name, create in _VIEWS:
        op.execute(create)


def upgrade() -> None:
    _drop_views()
    op.create_table("metric_counts_new", *_columns(with_id=False))
    op.execute(
        f"INSERT INTO metric_counts_new ({_COLUMNS}) SELECT {_COLUMNS} FROM metric_counts "
        f"WHERE id IN (SELECT max(id) FROM metric_counts GROUP BY {_KEY})"
    )
    op.drop_index(
        "ix_metric_counts_run_partition_global_step_data_source_metric", table_name="metric_counts"
    )
    op.drop_table("metric_counts")
    op.rename_table("metric_counts_new", "metric_counts")
    op.create_index(
        "uq_metric_counts_scope",
        "metric_counts",
        [
            "run",
            "partition",
            sa.text("coalesce(global_step, -1)"),
            sa.text("coalesce(data_source, '')"),
            "metric",
        ],
        unique=True,
    )
    _create_views()


def downgrade() -> None:
    _drop_views()
    op.create_table("metric_counts_old", *_columns(with_id=True))
    op.execute(
        f"INSERT INTO metric_counts_old ({_COLUMNS}) SELECT {_COLUMNS} FROM metric_counts ORDER BY {_KEY}"
    )
    op.drop_index("uq_metric_counts_scope", table_name="metric_counts")
    op.drop_table("metric_counts")
    op.rename_table("metric_counts_old", "metric_counts")
    op.create_index(
        "ix_metric_counts_run_partition_global_step_data_source_metric",
        "metric_counts",
        ["run", "partition", "global_step", "data_source", "metric"],
        unique=False,
    )
    _create_views()
