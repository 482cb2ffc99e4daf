"""Files shipped inside the package: the embedded default model.

`DEFAULT_MODEL` is the folder of the real pretrained stories260K Llama
(Karpathy's llama2.c TinyStories checkpoint, MIT; see its README and LICENSE).
Importing this module does not import torch.
"""

from pathlib import Path

DEFAULT_MODEL: str = str(Path(__file__).resolve().parent / "stories260K")
"""Path of the embedded default model, a Hugging Face Llama folder (about 1 MB)."""

DEFAULT_MODEL_NAME: str = "stories260K"
"""The name the servers report for the embedded model (`/v1/models`)."""
