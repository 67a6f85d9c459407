"""The dashboard page: one static HTML file (inline CSS and JS, canvas charts drawn by hand),
shipped as package data. The live server sends it as is; ``simulate --html`` embeds a recorded
run in it. Kept free of FastAPI and torch so the simulator can write it cheaply."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

DATA_PLACEHOLDER = "/*__KVLEDGER_DATA__*/null"


def page_template() -> str:
    """The dashboard page, shipped as package data (no build step)."""
    return (resources.files("kvledger.server") / "static" / "dashboard.html").read_text("utf-8")


def render_page(data: Any = None) -> str:
    """The page; ``data`` (a JSON-able dict) embeds a recorded run instead of polling."""
    if data is None:
        return page_template()
    # "</script>" or "<!--" inside the <script> element would end it early; "<" only occurs
    # inside JSON strings, where \u003c means the same.
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return page_template().replace(DATA_PLACEHOLDER, blob)
