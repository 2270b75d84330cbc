"""The maintenance leader: one lease row, so the sweeps run in one process of all replicas.

`generation.leader` holds, per name, the process (`holder`) that runs the periodic sweeps (lease
rescue, expiry, purge) and until when (`expires_at`, the database's clock). A process takes or
renews the row with one INSERT … ON CONFLICT DO UPDATE that wins only when the lease lapsed or
is already its own (service/housekeeping.py); a clean stop deletes it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-08
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE TABLE generation.leader (
    name text PRIMARY KEY,
    holder uuid NOT NULL,
    expires_at timestamptz NOT NULL
);
"""

DOWNGRADE = r"""
DROP TABLE generation.leader;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
