"""Decode-time sparsity parts (``kvbench.policies.sparse``), one module each: every module here registers its part
(``@register_sparsity``) when imported, and the registry imports them all on its first lookup."""
