"""Budget allocations (how the token budget splits across layers and across the KV heads of a layer), one module
each: every module here registers its allocation (``@register_allocation``) when imported, and the registry
imports them all on its first lookup."""
