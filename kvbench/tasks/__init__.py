"""Tasks, one module each: every module here registers its task (``@register_task``) when imported, and the
registry (``registry.TASKS``) imports them all on its first lookup."""
