"""``kvbench-lm-eval``: lm-eval's own command line with kvbench's model registered.

lm-eval finds models only in its own table, so this command imports kvbench's (``--model kvbench``) and hands the
arguments to lm-eval's parser and runner unchanged, with one addition: lm-eval's synthetic tasks (RULER) read the
tokenizer to size their prompts from ``--model_args`` or ``--metadata``, and kvbench's ``model=`` names a config,
not a tokenizer, so the model's own tokenizer is passed as ``tokenizer=`` where neither gives one. The kvbench
settings are checked first, so a bad one fails before lm-eval loads anything, and a task lm-eval does not know is
one message, not lm-eval's traceback.
"""

from __future__ import annotations

import sys
from typing import Any

from kvbench.config import ConfigError

UNKNOWN_TASK = "Tasks not found: "  # how lm-eval's task resolution words it (lm_eval/config/evaluate_config.py)
MISSING_EXTRA = (
    "kvbench-lm-eval needs lm-eval, an optional extra of kvbench: pip install 'kvbench[lm-eval]' "
    "(or bash scripts/setup.sh)"
)


def tokenizer_location(model: dict[str, Any]) -> str | None:
    """Where the model's tokenizer loads from (a directory or hub id); None for the tiny model, built in memory."""
    from kvbench.models import checkpoint_path

    if model["source"] == "tiny":
        return None
    return checkpoint_path(model["source"], model.get("name_or_path"), model.get("cache_dir"), model.get("embedded"))[0]


def add_tokenizer(model_args: dict[str, Any], metadata: dict[str, Any] | None) -> dict[str, Any]:
    """``model_args`` checked as kvbench settings, with ``tokenizer=`` added where neither they nor ``metadata``
    name one."""
    from kvbench.lm_eval.settings import run_spec

    given = {k: v for k, v in model_args.items() if k != "tokenizer"}
    spec = run_spec(given)
    if "tokenizer" in model_args or "tokenizer" in (metadata or {}):
        return model_args
    location = tokenizer_location(spec.model)
    return {**model_args, "tokenizer": location} if location else model_args


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's command line with ``--model kvbench`` available; exit 2 with one message on bad input."""
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:
        print(MISSING_EXTRA, file=sys.stderr)
        sys.exit(2)
    import kvbench.lm_eval.model  # noqa: F401  (registers --model kvbench)

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    try:
        if getattr(args, "model", None) == "kvbench":
            args.model_args = add_tokenizer(dict(args.model_args or {}), getattr(args, "metadata", None))
        parser.execute(args)
    except ConfigError as err:
        print(f"kvbench: {err}", file=sys.stderr)
        sys.exit(2)
    except ValueError as err:
        if not str(err).startswith(UNKNOWN_TASK):
            raise
        names = str(err).removeprefix(UNKNOWN_TASK)
        print(
            f"kvbench-lm-eval: lm-eval has no task {names}: `kvbench-lm-eval ls tasks` lists the tasks it has "
            "(a task of your own: --include_path DIR)",
            file=sys.stderr,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
