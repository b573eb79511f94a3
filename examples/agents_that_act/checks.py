"""The Python steps of examples/agents_that_act/pipeline.yaml: plain functions, no model."""

from __future__ import annotations

import re


def classify(document: str) -> str:
    """What kind of document this is, from words only a licence or a contract uses."""
    text = document.lower()
    if "license" in text or "licence" in text:
        return "licence"
    if "agreement" in text or "the parties" in text:
        return "contract"
    return "other"


def sections(document: str) -> dict[str, object]:
    """The numbered section headings of the document (lines like '3. Protecting Users')."""
    found = re.findall(r"^\s*(\d{1,2})\.\s+([A-Z][^\n]{2,60})$", document, re.MULTILINE)
    return {"count": len(found), "titles": [title.strip() for _, title in found][:12]}
