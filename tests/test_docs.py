"""The docs stay true: every setting the service reads is in docs/OPERATIONS.md."""

from __future__ import annotations

from dataclasses import fields

from service.settings import Settings, env_names
from tests.conftest import ROOT


def test_every_setting_is_documented() -> None:
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for field in fields(Settings):
        for name in env_names(field.name):
            assert f"`{name}`" in operations, f"{name} is missing from docs/OPERATIONS.md"
