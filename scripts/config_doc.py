"""The generated tables of docs/configuration.md, rendered from the pydantic models that define the settings.

    python scripts/config_doc.py            # exit 1 and name the stale tables if the page is out of date
    python scripts/config_doc.py --write    # rewrite the tables in place

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` in the page; everything else
in the page is hand-written. tests/unit/test_config_doc.py runs the check, so a setting cannot be added,
renamed or re-described without the page following.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

from service.imaging.config import Postprocess, Preprocess  # noqa: E402
from service.model_config import ModelConfig  # noqa: E402
from service.settings import ADVANCED, ENV_PREFIX, REMOVED, USER, ServiceSettings  # noqa: E402


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) if all(isinstance(v, int) for v in value) else str(list(value))
    return str(value)


def _bounds(field: FieldInfo) -> str:
    """``ge``/``le``/``gt`` of a field (also those of its Annotated type) as text, e.g. ``1..4096``."""
    low = high = None
    metadata = list(field.metadata)
    for arg in typing.get_args(field.annotation):  # Optional[Annotated[int, Field(ge=1)]] keeps them inside
        for item in getattr(arg, "__metadata__", ()):
            metadata += getattr(item, "metadata", [item])  # a FieldInfo carries its Ge/Le in .metadata
    for item in metadata:
        low = getattr(item, "ge", None) if getattr(item, "ge", None) is not None else low
        low = f">{item.gt}" if getattr(item, "gt", None) is not None else low
        high = getattr(item, "le", None) if getattr(item, "le", None) is not None else high
    if low is None and high is None:
        return ""
    if isinstance(low, str):
        return f"{low}" + (f", <={high}" if high is not None else "")
    return f"{'' if low is None else low}..{'' if high is None else high}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(names: tuple[str, ...]) -> str:
    rows = ["| variable | default | range | meaning |", "|---|---|---|---|"]
    for name in names:
        field = ServiceSettings.model_fields[name]
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | `{_cell(_default(field))}` | {_bounds(field)} | "
                    f"{_cell(field.description or '')} |")
    return "\n".join(rows)


def model_table(model: type[BaseModel], skip: tuple[str, ...] = ()) -> str:
    rows = ["| key | default | range | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        default = _default(field)
        rows.append(f"| `{name}` | `{_cell(default)}` | {_bounds(field)} | {_cell(field.description or '')} |")
    return "\n".join(rows)


def removed_table() -> str:
    rows = ["| variable | instead |", "|---|---|"]
    rows += [f"| `{ENV_PREFIX}{name}` | {_cell(instead)} |" for name, instead in sorted(REMOVED.items())]
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str]] = {
    "user-settings": lambda: settings_table(USER),
    "removed-settings": removed_table,
    "advanced-settings": lambda: settings_table(ADVANCED),
    "model-config": lambda: model_table(ModelConfig),
    "preprocess": lambda: model_table(Preprocess),
    "postprocess": lambda: model_table(Postprocess),
}


def render(page: str) -> tuple[str, list[str]]:
    """``page`` with every generated table replaced by its current rendering, and the names that changed."""
    stale: list[str] = []
    for name, make in TABLES.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(<!-- end: {name} -->)", re.S)
        match = pattern.search(page)
        if match is None:
            raise SystemExit(f"{PAGE.name}: no '<!-- generated: {name} -->' ... '<!-- end: {name} -->' block")
        table = make() + "\n"
        if match.group(2) != table:
            stale.append(name)
        page = page[: match.start(2)] + table + page[match.end(2):]
    return page, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the page's tables in place")
    args: Any = parser.parse_args(argv)
    page, stale = render(PAGE.read_text(encoding="utf-8"))
    if args.write:
        PAGE.write_text(page, encoding="utf-8")
        print(f"{PAGE.relative_to(ROOT)}: rewrote {', '.join(stale) or 'nothing (up to date)'}")
        return 0
    if stale:
        print(f"{PAGE.relative_to(ROOT)} is out of date ({', '.join(stale)}): run python scripts/config_doc.py --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
