"""Reports of simulation results: tables, Markdown, JSON and plots."""
