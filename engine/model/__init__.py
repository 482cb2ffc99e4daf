"""Model execution: the typed model config, one file per model family (`families`), the model shell and its
blocks, checkpoint loading."""
