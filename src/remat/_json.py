"""Reading remat's JSON files (profile.json, plan.json, measure.json) with errors a user can act on."""

from __future__ import annotations

import json
from typing import Any

from remat.errors import RematError


def load(text: str, what: str, schema_version: int) -> dict[str, Any]:
    """Parse ``text`` as the JSON object of a ``what`` with ``schema_version``.

    Raises:
        RematError: If the text is not JSON, not an object, or of another schema version.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RematError(f"{what} json: not valid JSON ({e.msg} at line {e.lineno}); give a file written by remat") from None
    if not isinstance(data, dict) or data.get("schema_version") != schema_version:
        found = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
        raise RematError(f"{what} json: schema_version {found!r} is not {schema_version}; re-create it with this remat")
    return data
