"""The token-budget scheduler, its small managers (pages, admission) and the plan of a step (`output.py`)."""
