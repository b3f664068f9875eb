"""Reading the simulator's input documents (YAML or JSON) with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_document"]


def read_document(path: Path, error: type[Exception], what: str) -> Any:
    """Parse ``path`` as JSON (``.json``) or YAML (anything else).

    Raises ``error`` naming the file: ``cannot read <what> file <path>: <reason>`` when it cannot
    be read, ``<path>: not valid JSON|YAML: <parser message>`` when it does not parse.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise error(f"cannot read {what} file {path}: {e.strerror}") from None
    is_json = path.suffix == ".json"
    try:
        return json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise error(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {e}") from None
