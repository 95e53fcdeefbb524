"""Eviction scopes (which tokens are shielded from eviction whatever their score), one module each: every module
here registers its scope (``@register_scope``) when imported, and the registry imports them all on its first
lookup."""
