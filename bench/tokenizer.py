"""Load the server's tokenizer without importing torch.

pd-bench measures prompt lengths and synthesises prompts with the target's
tokenizer. It reads ``tokenizer.json`` with the Rust ``tokenizers`` library
(the file behind every Hugging Face "fast" tokenizer): from a local model
folder, or from the Hugging Face Hub for a repository id. Importing
``transformers.AutoTokenizer`` would import torch (seconds of start-up), so it
is only the fallback for models that ship no ``tokenizer.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from pd_cluster.engine.assets import DEFAULT_MODEL, DEFAULT_MODEL_NAME


class _Backend(Protocol):
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Tokenizer:
    """Token counting and synthesis with one model's tokenizer.

    ``encode`` adds no special tokens (BOS and chat templates belong to the
    server), so a prompt's length is the number of tokens of its text.
    """

    name: str
    backend: Any

    def encode(self, text: str) -> list[int]:
        return self.backend.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.backend.encode_batch(texts)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)

    def vocab(self) -> dict[str, int]:
        return self.backend.vocab()


class _RustBackend:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(path)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=False)


class _TransformersBackend:
    def __init__(self, name: str, trust_remote_code: bool) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._tok.encode(t, add_special_tokens=False) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab())


def resolve_tokenizer_name(tokenizer: str | None, model: str | None) -> str:
    """``--tokenizer`` if given, else the model's; the embedded model's folder for ``stories260K``.

    Raises ``ValueError`` when neither is known.
    """
    if tokenizer:
        return DEFAULT_MODEL if tokenizer == DEFAULT_MODEL_NAME else tokenizer
    if not model:
        raise ValueError("no tokenizer: pass --tokenizer PATH (or --model)")
    if model == DEFAULT_MODEL_NAME or os.path.basename(model.rstrip("/")) == DEFAULT_MODEL_NAME:
        return model if os.path.isdir(model) else DEFAULT_MODEL
    return model


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Tokenizer:
    """Load ``name`` (a local folder, a ``tokenizer.json`` file, or a Hub repository id).

    Raises ``OSError`` when nothing can be found.
    """
    if os.path.isfile(name):
        return Tokenizer(name, _RustBackend(name))
    if os.path.isdir(name):
        path = os.path.join(name, "tokenizer.json")
        if os.path.isfile(path):
            return Tokenizer(name, _RustBackend(path))
        return Tokenizer(name, _TransformersBackend(name, trust_remote_code))
    try:
        from huggingface_hub import hf_hub_download

        return Tokenizer(name, _RustBackend(hf_hub_download(name, "tokenizer.json")))
    except Exception:  # no tokenizer.json on the Hub: the slow path
        return Tokenizer(name, _TransformersBackend(name, trust_remote_code))
