"""The token-budget scheduler and its small managers (pages, admission)."""
