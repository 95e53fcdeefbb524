"""Tasks register themselves on import; importing this package makes every one available."""
from kvbench.tasks import jsonl, retrieval  # noqa: F401
from kvbench.tasks import longbench, summarization  # noqa: F401
from kvbench.tasks import instructions, perplexity  # noqa: F401
