"""What must hold after any fault (GUIDE §5), checked in SQL for the tools a test used."""

from __future__ import annotations

from typing import Any

import psycopg

Db = psycopg.Connection[dict[str, Any]]

TERMINAL = ("completed", "failed", "cancelled", "expired")
COUNTED = ("retry", "failed", "abandoned", "lease_lost")
"""Attempt outcomes that use one of the task's runs (docs/ARCHITECTURE.md, "Counting runs")."""


def assert_invariants(db: Db, tool_id: str, acknowledged: list[str] = ()) -> None:  # type: ignore[assignment]
    """No task a client was told about is missing; at most one settlement per task and round,
    and none on a task that may run again; runs within max_retries; nothing processing long past
    its lease; the tool's spend and reservation counters equal the attempts ledger."""
    if acknowledged:
        found = db.execute(
            "SELECT count(*) AS n FROM generation.tasks WHERE id = ANY(%s::uuid[])",
            [list(acknowledged)],
        ).fetchone()
        assert found == {"n": len(set(acknowledged))}, "an acknowledged task is missing"

    unsettled_live = db.execute(
        "SELECT id FROM generation.tasks WHERE tool_id = %s "
        "AND status NOT IN ('completed', 'failed', 'cancelled', 'expired') "
        "AND (settled_at IS NOT NULL OR EXISTS (SELECT 1 FROM generation.settlements AS s "
        "     WHERE s.task_id = tasks.id AND s.settlement_round = tasks.settlement_round))",
        [tool_id],
    ).fetchall()
    assert unsettled_live == [], "a task that may run again holds a settlement of its round"

    over = db.execute(
        "SELECT t.id, t.max_retries, t.retry_count, "
        "       (SELECT count(*) FROM generation.attempts AS a "
        "        WHERE a.task_id = t.id AND a.outcome::text = ANY(%s)) AS runs "
        "FROM generation.tasks AS t WHERE t.tool_id = %s AND t.settlement_round = 1",
        [list(COUNTED), tool_id],
    ).fetchall()
    for task in over:
        assert task["retry_count"] <= task["max_retries"], task
        assert task["runs"] <= max(task["max_retries"], 1), f"ran more than allowed: {task}"

    stuck = db.execute(
        "SELECT id FROM generation.tasks WHERE tool_id = %s AND status = 'processing' "
        "AND claim_expires_at < now() - interval '30 seconds'",
        [tool_id],
    ).fetchall()
    assert stuck == [], "processing long past its lease"

    # Every counter is the local day's and matches the ledger; the tool's share covers it, and
    # the settings row's total is the sum of the shares.
    money = db.execute(
        "SELECT CASE WHEN t.spent_day = d.today THEN t.reserved_nanos ELSE 0 END AS reserved, "
        "       CASE WHEN t.spent_day = d.today THEN t.spent_nanos ELSE 0 END AS spent, "
        "       CASE WHEN t.spent_day = d.today THEN t.granted_nanos ELSE 0 END AS granted, "
        "       (SELECT COALESCE(sum(a.estimate_nanos), 0) FROM generation.attempts AS a "
        "        WHERE a.tool_id = t.id AND a.outcome = 'running' AND a.local_day = d.today) "
        "         AS ledger_reserved, "
        "       (SELECT COALESCE(sum(a.cost_nanos), 0) FROM generation.attempts AS a "
        "        WHERE a.tool_id = t.id AND a.local_day = d.today) AS ledger_spent, "
        "       CASE WHEN s.granted_day = d.today THEN s.granted_nanos ELSE 0 END AS total, "
        "       (SELECT COALESCE(sum(x.granted_nanos), 0) FROM generation.tools AS x "
        "        WHERE x.spent_day = d.today) AS shares "
        "FROM generation.tools AS t, generation.settings AS s, generation.spend_today AS d "
        "WHERE t.id = %s",
        [tool_id],
    ).fetchone()
    assert money is not None
    assert money["reserved"] == money["ledger_reserved"], money
    assert money["spent"] == money["ledger_spent"], money
    assert money["spent"] + money["reserved"] <= money["granted"], money
    assert money["total"] == money["shares"], money
