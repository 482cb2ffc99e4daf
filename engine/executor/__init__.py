"""Executors: one rank's model and KV pool (`Shard`), and the tensor-parallel rank processes that run it
in lockstep (`TPDriver`, `RankServer`). `engine.parallel` holds only the process group they use."""
