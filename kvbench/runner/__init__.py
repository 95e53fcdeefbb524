"""Running cells: ``cell`` (one cell: validate, resume, rows, summary), ``example`` (one example -> its outcome,
alone or batched), ``perplexity`` (teacher-forced scoring of texts), ``passes`` (the run's policy over a prompt and
what it measured), ``prompts`` (rendering and budget checks before weights load), ``model_cache`` (one model per
process, warmed up), ``capacity_cell`` (the largest batch under a memory cap), ``paths`` (a cell's directory),
``fidelity`` (everything about fidelity to the full cache)."""
