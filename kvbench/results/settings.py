"""A cell's settings: what its config changes of its named model's, task's and policy's defaults.

Every row records them (``settings``: dotted key -> value), the cell's directory spells them
(``kvbench.runner.paths``) and the report labels cells by them (``kvbench.report.labels``). A key belongs to
the model, task or policy it starts with (``policy.scope.window``, ``task.path``); any other key
(``max_new_tokens``, ``sampling.temperature``) to the run.
"""

from __future__ import annotations

import json
import math
from typing import Any

GROUPS = ("model", "task", "policy")
RUN = "run"


def owner(key: str) -> tuple[str, str]:
    """The group a dotted key belongs to and the key within it: ``policy.scope.window`` -> (policy,
    scope.window); ``max_new_tokens`` -> (run, max_new_tokens)."""
    head, _, rest = key.partition(".")
    return (head, rest) if head in GROUPS and rest else (RUN, key)


def value_text(value: Any) -> str:
    """A setting's value as the directory and the labels spell it: YAML's words for booleans and null, floats
    as Python writes them, lists and mappings as compact JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)
