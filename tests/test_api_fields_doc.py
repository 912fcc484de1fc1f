"""docs/API-FIELDS.md is the table of the request-field audits of every API (router/openai/fields.py,
router/anthropic/fields.py, router/responses/fields.py) as scripts/api-fields writes it: a table changed without
the doc, or the doc edited by hand, fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("api_fields", ROOT / "scripts" / "api_fields.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fields_doc_is_what_the_tables_give():
    """The file equals the generator's text; every accepted key's stated effect and every refused key's advice
    is in it, and every Responses key the SDK defines has a row."""
    from router.responses.fields import RESPONSES_ACCEPTED, RESPONSES_REFUSED

    generator = _generator()
    text = (ROOT / "docs" / "API-FIELDS.md").read_text()
    assert text == generator.render(), "docs/API-FIELDS.md is out of date: run scripts/api-fields"
    responses = text.split("## Responses", 1)[1]
    for key, effect in RESPONSES_ACCEPTED.items():
        assert f"| `{key}` | accepted | {generator.cell(effect)} |" in responses
    for key, refusal in RESPONSES_REFUSED.items():
        assert f"| `{key}` | refused | {generator.cell(refusal.advice)} |" in responses
    assert "| `reasoning` | honoured |" in responses and "| `store` | accepted |" in responses
    assert generator.main(["--check"]) == 0
