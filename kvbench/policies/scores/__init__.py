"""Importance scores, one module each: every module here registers its score (``@register_score``) when imported,
and the registry imports them all on its first lookup, so a new score is a new module (plus a policy config).

A score maps a layer's ``TokenState`` to a float [kv_heads, n]; higher survives. Attention statistics (see
``policies.statistics``) are computed per *query* head, then the query heads of a group are reduced to their KV
head by the MEAN of their attention probabilities (engine.attention), so every score is per KV head, the unit the
cache stores.
"""
