"""Names and bytes of pages in the cluster-wide KV store: which model, layout and prefix a page holds, checked on
every read.

**Key.** ``pdkv<version>/<model>/<model fingerprint>/<kv dtype>/p<page size>/<layout hash>/<prefix digest>``:

- the model's name (readable; any character outside ``[A-Za-z0-9._-]`` becomes ``_``) and its *fingerprint*:
  SHA-256 over `LoadedModel.identity` (the config and every tensor's name, shape and dtype: the KV handshake's
  model check), the weights' dtype, and 64 KiB read at three offsets of every weights file (so two fine-tunes of
  one base model, equal in config and shapes, still differ); dummy weights hash their seed instead;
- the KV cache dtype and the page size, and `KVLayout.hash` (shape, dtype, FP8 scales, TP slice, byte order:
  what makes two pools' pages the same bytes);
- the prefix digest: the 128-bit chained BLAKE2b of the page and every page before it
  (`pd_cluster.engine.kv.events.page_hash` with ``digest_size=16``), so a key names a whole prefix.

Two workers share a page only when all of these agree: a worker of another model, dtype, page size or layout
computes other keys and never reads the page. The format version changes when the value's layout does.

**Value.** A header (magic ``PDKV``, format version, lengths), the key, the page's token ids (u32 each), the
page's raw bytes in the pool's storage dtype (FP8 pages as their bits), and a 16-byte BLAKE2b of all of it.
`decode_page` refuses a value whose magic, version, lengths, checksum, key or token ids do not match what the
reader expected (`BadPage`): such a page is never used, the reader recomputes it.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pd_cluster.engine.kv.events import page_hash

FORMAT_VERSION = 1
MAGIC = b"PDKV"
_HEADER = struct.Struct("<4sHHIIQ")  # magic, version, reserved, key bytes, tokens, payload bytes
_CHECKSUM = 16
_SAMPLE = 64 * 1024
DIGEST_SIZE = 16  # bytes of the chained prefix digest


class BadPage(ValueError):
    """A stored value that must not be used; ``reason``: ``magic``, ``version``, ``length``, ``checksum``, ``key``
    or ``tokens``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"bad page in the KV store ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


@dataclass(frozen=True)
class PageNamespace:
    """What a page's key says besides its prefix (module docstring).

    Attributes:
        model: the served model name (readable part only).
        model_fingerprint: hex digest naming the exact weights (`model_fingerprint`).
        kv_dtype: the pool's KV cache dtype.
        page_size: tokens per page.
        layout_hash: `KVLayout.hash()` of the pool.
        version: the value format (`FORMAT_VERSION`).
    """

    model: str
    model_fingerprint: str
    kv_dtype: str
    page_size: int
    layout_hash: str
    version: int = FORMAT_VERSION

    @property
    def prefix(self) -> str:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", self.model)[:64] or "model"
        return (f"pdkv{self.version}/{name}/{self.model_fingerprint[:24]}/{self.kv_dtype}/p{self.page_size}/"
                f"{self.layout_hash}/")

    def key(self, digest: int) -> str:
        """The key of the page whose chained prefix digest is `digest`."""
        return f"{self.prefix}{digest:0{2 * DIGEST_SIZE}x}"


def prefix_digests(token_ids: Sequence[int], page_size: int, num_pages: int) -> list[int]:
    """The chained 128-bit digests of the first `num_pages` full pages of `token_ids` (page 0 first)."""
    out, parent = [], 0
    for i in range(num_pages):
        parent = page_hash(parent, token_ids[i * page_size:(i + 1) * page_size], DIGEST_SIZE)
        out.append(parent)
    return out


def encode_page(key: str, tokens: Sequence[int], payload: bytes | memoryview) -> bytes:
    """The stored value of one page (module docstring). `payload`: the page's raw bytes."""
    kb = key.encode()
    body = b"".join((_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(kb), len(tokens), len(payload)), kb,
                     struct.pack(f"<{len(tokens)}I", *tokens), payload))
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM).digest()


def decode_page(value: bytes | memoryview, key: str, tokens: Sequence[int], nbytes: int) -> memoryview:
    """The payload of a stored value, after every check (module docstring).

    Args:
        value: what the store returned.
        key: the key it was read under.
        tokens: the page's token ids as the reader has them.
        nbytes: the page's size in the reader's pool.

    Raises:
        BadPage: the value must not be used.
    """
    mv = memoryview(value)
    if len(mv) < _HEADER.size + _CHECKSUM:
        raise BadPage("length", f"{len(mv)} bytes")
    magic, version, _, klen, ntok, plen = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise BadPage("magic")
    if version != FORMAT_VERSION:
        raise BadPage("version", f"format {version}, this build reads {FORMAT_VERSION}")
    body_len = _HEADER.size + klen + 4 * ntok + plen
    if len(mv) != body_len + _CHECKSUM or plen != nbytes or ntok != len(tokens):
        raise BadPage("length", f"{len(mv)} bytes for a {nbytes}-byte page of {len(tokens)} tokens")
    if hashlib.blake2b(mv[:body_len], digest_size=_CHECKSUM).digest() != bytes(mv[body_len:]):
        raise BadPage("checksum")
    at = _HEADER.size
    if bytes(mv[at:at + klen]) != key.encode():
        raise BadPage("key")
    at += klen
    if list(struct.unpack_from(f"<{ntok}I", mv, at)) != list(tokens):
        raise BadPage("tokens")
    at += 4 * ntok
    return mv[at:at + plen]


def model_fingerprint(identity: str, dtype: str, weight_files: Sequence[Path] = ()) -> str:
    """SHA-256 hex of the model identity, the weights' dtype and three 64 KiB samples of each weights file (start
    of its data, middle, end); see the module docstring."""
    h = hashlib.sha256(f"{identity}|{dtype}".encode())
    for path in weight_files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            start = 8 + int.from_bytes(head, "little") if len(head) == 8 else 0  # past the safetensors header
            for at in sorted({min(start, size), max(start, (start + size) // 2 - _SAMPLE // 2),
                              max(start, size - _SAMPLE)}):
                f.seek(at)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()
