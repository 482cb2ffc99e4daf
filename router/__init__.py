"""pd-router: the OpenAI-compatible router in front of prefill, decode and mixed workers.

See ``docs/router.md`` for flags, policies, metrics and deployment, and
``docs/worker-api.md`` for the contract with the workers.
"""
