"""`pd-plan`: the KV-cache memory planner (torch-free)."""
