"""Fidelity to the full cache, all of it: the measures (``metrics``: KL, top-1 agreement, ROUGE-L between two
predictions, NLL), the full cache's references and the comparison with them (``references``), and the store
that keeps references on disk, each computed once (``store``)."""
