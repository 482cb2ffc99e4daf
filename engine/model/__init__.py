"""Model definitions and checkpoint loading (Llama family)."""
