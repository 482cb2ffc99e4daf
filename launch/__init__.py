"""Launchers: `pd-serve` (a local cluster), `pd-worker` (one worker of any role), `pd-generate` (offline)."""
