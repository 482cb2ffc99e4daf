"""The cluster-wide KV store behind the host tier (SGLang's HiCache L3): Mooncake Store or a directory.

`keys` names and checks pages, `backends` talks to the store, `tier` moves pages between the store and the
prefix cache (write-through, prefetch on arrival), `sizing` reads the configuration. ``docs/kv-store.md``.
"""
