"""API tokens and the audit log.

`generation.tokens` holds each token's roles, tools, expiry and revocation, and only the SHA-256
of its secret; `generation.audit` records who made each audited change (docs/OPERATIONS.md,
"Securing genq"). Additive: replicas of 0007 keep serving beside it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE TABLE generation.tokens (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    secret_sha256 bytea NOT NULL,
    roles text[] NOT NULL,
    tools text[] NOT NULL DEFAULT '{}',
    note text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    revoked_at timestamptz,
    CONSTRAINT tokens_roles_known CHECK (
        cardinality(roles) >= 1
        AND roles <@ ARRAY['gateway', 'worker', 'reconciler', 'operator', 'viewer']),
    CONSTRAINT tokens_secret_length CHECK (octet_length(secret_sha256) = 32)
);

CREATE TABLE generation.audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL,
    action text NOT NULL,
    detail jsonb NOT NULL DEFAULT '{}'
);
"""

DOWNGRADE = r"""
DROP TABLE generation.audit;
DROP TABLE generation.tokens;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
