"""docs/configuration.md follows the code: its generated tables equal what scripts/config_doc.py renders from
the pydantic models now, and every setting, removed variable and per-model key is on the page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from service.model_config import ModelConfig
from service.settings import ENV_PREFIX, REMOVED, ServiceSettings

ROOT = Path(__file__).resolve().parents[2]


def _config_doc():
    spec = importlib.util.spec_from_file_location("config_doc", ROOT / "scripts" / "config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_tables_are_current() -> None:
    doc = _config_doc()
    _, stale = doc.render((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"))
    assert stale == [], f"run python scripts/config_doc.py --write (stale: {stale})"


def test_every_setting_and_model_key_is_documented() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for name, field in ServiceSettings.model_fields.items():
        assert f"`{ENV_PREFIX}{name.upper()}`" in page
        assert (field.description or "").replace("|", "\\|") in page
    for name in REMOVED:
        assert f"`{ENV_PREFIX}{name}`" in page
    for name in ModelConfig.model_fields:
        assert f"| `{name}` |" in page


def test_a_changed_description_makes_the_page_stale() -> None:
    doc = _config_doc()
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    tampered = page.replace("HTTP port (0: pick a free one).", "HTTP port.")
    assert tampered != page
    assert doc.render(tampered)[1] == ["user-settings"]
