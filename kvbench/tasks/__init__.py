"""Tasks register themselves on import; importing this package makes every one available."""

from kvbench.tasks import instructions, jsonl, longbench, perplexity, retrieval, summarization  # noqa: F401  # noqa: F401  # noqa: F401
