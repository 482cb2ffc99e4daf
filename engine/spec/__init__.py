"""Speculative decoding: draft tokens checked by one target extend per step, lossless (`docs/speculative-decoding.md`)."""
