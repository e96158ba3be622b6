"""docs/operator.md's table of condition reasons names every reason the operator sets on a ModelLoad, each
in the row that says what happens next as the code does it (retried with backoff, or stopped)."""

from __future__ import annotations

import re
from pathlib import Path

from modelload.loader import errors
from modelload.operator.resolve import _FIX_ELSEWHERE

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "modelload" / "operator"


def table_rows() -> dict[str, str]:
    """Each reason of the table, with its row's ``phase | next`` cells."""
    doc = (ROOT / "docs" / "operator.md").read_text()
    table = doc[doc.index("Condition reasons, and what happens next") :]
    table = table[: table.index("\n\n", table.index("| reason |"))]
    rows: dict[str, str] = {}
    for line in table.splitlines()[3:]:
        reasons, rest = line.strip("|").split("|", 1)
        for reason in re.findall(r"`(\w+)`", reasons):
            rows[reason] = rest
    return rows


def test_every_reason_the_operator_sets_is_in_the_table() -> None:
    code = "".join(path.read_text() for path in OPERATOR.glob("*.py"))
    set_by_secrets = set(re.findall(r'SecretProblemError\(\s*"(\w+)"', code))
    set_by_secrets |= set(re.findall(r'CloudSecretError\(\s*"(\w+)"', code))
    set_by_errors = {
        cls.condition for cls in vars(errors).values() if isinstance(cls, type) and hasattr(cls, "condition")
    } - {"Error"}
    rows = table_rows()
    assert {"SecretNotFound", "BadToken"} <= set_by_secrets
    missing = (set_by_secrets | set_by_errors | {"Resolved"}) - set(rows)
    assert not missing, f"docs/operator.md's condition table lacks {sorted(missing)}"


def test_the_reasons_retried_with_backoff_are_the_ones_the_code_retries() -> None:
    rows = table_rows()
    documented = {reason for reason, row in rows.items() if "Failed" in row and "retried with backoff" in row}
    assert documented == set(_FIX_ELSEWHERE)
