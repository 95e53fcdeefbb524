"""Figures, tables and report.md from kvbench result rows (``kvbench-report``)."""
