"""Tokenizer sanity at load: a tokenizer saved by one transformers version can load under another as the
wrong class (SmolLM2 saved by 5.2 loads under 5.24 as CodeLlamaTokenizer: spaces encode to id 0, EOS becomes
``<|im_start|>``), and nothing else would warn. Every score would then be silently wrong.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# Spaces, punctuation, digits and a newline: a tokenizer loaded as the wrong class typically maps
# spaces to the unknown token, which this text exposes on the first word boundary.
SANITY_TEXT = "The year 2024 had 366 days, not 365!\nQ: what is 3.14 * 2? A: 6.28 (rounded)."
_START_LIKE = re.compile(r"start|begin|^<s>$|^<bos>$|^\[CLS\]$", re.IGNORECASE)


def _saved_by(path: Path | None) -> str:
    """The transformers version recorded in a local checkpoint's config.json, if any."""
    try:
        return json.loads((path / "config.json").read_text())["transformers_version"]  # type: ignore[operator]
    except (OSError, KeyError, TypeError, ValueError):
        return "an unknown version"


def _declared_class(path: Path | None) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")  # type: ignore[operator]
    except (OSError, TypeError, ValueError, AttributeError):
        return None


def tokenizer_problem(tokenizer: Any) -> str | None:
    """What is wrong with a tokenizer, or ``None``: the fixed text must survive encode → decode
    and the EOS must be a real end token (a special token that is not a start marker)."""
    ids = list(tokenizer.encode(SANITY_TEXT, add_special_tokens=False))
    decoded = tokenizer.decode(ids)
    # SentencePiece models may keep their dummy-prefix space on decode; that one space is harmless.
    if decoded not in (SANITY_TEXT, " " + SANITY_TEXT):
        unk = getattr(tokenizer, "unk_token_id", None)
        hint = f", {ids.count(unk)} of {len(ids)} ids are the unknown token {unk}" if unk in ids else ""
        shown = decoded if len(decoded) <= 120 else decoded[:120] + "…"
        return f"encode → decode of {SANITY_TEXT!r} gave {shown!r}{hint}"
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos_id is None:
        return "it has no EOS token"
    if _START_LIKE.search(str(eos)):
        return f"its EOS {eos!r} (id {eos_id}) is a start token, so generation would never stop on it"
    shown = tokenizer.decode([eos_id])
    if shown not in tokenizer.all_special_tokens:
        return f"its EOS id {eos_id} decodes to {shown!r}, which is not a special token"
    return None


def check_tokenizer(tokenizer: Any, path: str | os.PathLike | None = None, fix: str | None = None) -> None:
    """Raise ``ValueError`` naming the cause and the fix when :func:`tokenizer_problem` finds one."""
    import transformers

    problem = tokenizer_problem(tokenizer)
    if problem is None:
        return
    local = Path(path) if path is not None and Path(path).is_dir() else None
    declared = _declared_class(local)
    loaded_as = type(tokenizer).__name__
    as_declared = f" (tokenizer_config.json says {declared})" if declared and declared != loaded_as else ""
    fix = fix or (
        "pass a tokenizer that loads correctly under this transformers version, or fix tokenizer_class "
        "in tokenizer_config.json"
    )
    raise ValueError(
        f"tokenizer at {path} is broken: {problem}. It was saved by transformers {_saved_by(local)} and loaded as "
        f"{loaded_as}{as_declared} under transformers {transformers.__version__}. Fix: {fix}"
    )
