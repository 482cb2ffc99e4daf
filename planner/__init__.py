"""Elastic PD's planner: sizes each role to TTFT and ITL targets (`decision.Planner`, pure), configured by
`config.PlannerConfig` and its flags. Imports nothing of ours but `common`."""
