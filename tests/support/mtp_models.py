"""Tiny DeepSeek-V3 checkpoints with a multi-token-prediction (MTP) layer, for NEXTN speculative decoding.

transformers builds and saves the target (`deepseek_models.build`); its DeepseekV3 class has no MTP module, so
the MTP layer is added here as DeepSeek-V3's release stores it, under ``model.layers.{num_hidden_layers}.``:
``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, a full decoder block (an MoE block, like the release's: the
names of the target's last layer), ``shared_head.norm`` and ``shared_head.head``, in an extra safetensors file
listed in the index, with ``num_nextn_predict_layers: 1`` in config.json. transformers ignores these tensors, so
its greedy loop is the reference either way.

- `random_mtp`: random MTP weights: drafts are almost always rejected; `reference_drafts` gives the drafts it
  should propose, by full recompute with transformers' decoder layer as the MTP block.
- `echo_mtp`: a target whose blocks' outputs are scaled down 1000x (its next token depends almost only on the
  current one: ``lm_head(norm(embed(x_t)))``) and an MTP layer built to compute that same function of its input
  token (``eh_proj`` passes the embedding half, the block's outputs scaled down alike, the target's head): most
  drafts are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from deepseek_models import build
from safetensors import safe_open
from safetensors.torch import save_file

MTP_FILE = "model-mtp.safetensors"


def _block_like(folder: Path, layer: int, copy: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors (with `copy`, the stored values) with the stored names and shapes of the saved decoder
    layer `layer` (relative names; the release's per-expert names, as transformers' ``save_pretrained`` writes
    them)."""
    prefix = f"model.layers.{layer}."
    where = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in sorted(where.items()):
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        with safe_open(str(folder / file), framework="pt") as f:
            shape = f.get_slice(name).get_shape()
            if copy:
                out[rest] = f.get_tensor(name)
                continue
        if "norm" in rest:
            out[rest] = 1 + 0.1 * torch.randn(shape)
        elif rest.endswith("e_score_correction_bias"):
            out[rest] = 0.1 * torch.randn(shape)
        else:
            out[rest] = torch.randn(shape) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.1)
    return out


def _write(folder: Path, hf, mtp: dict[str, torch.Tensor]) -> None:
    n = hf.config.num_hidden_layers
    tensors = {f"model.layers.{n}.{k}": v.contiguous() for k, v in mtp.items()}
    save_file(tensors, str(folder / MTP_FILE), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
    index.write_text(json.dumps(data))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))


def random_mtp(folder: Path, seed: int = 0):
    """The `deepseek_models` V3 target with a random MTP layer; returns transformers' model (the reference).

    The MTP block is layer N of a random transformers model with one more layer (saved beside, for the
    release's tensor names); `reference_drafts` runs that module."""
    hf = build("deepseek-v3", folder, seed=seed)
    n, h = hf.config.num_hidden_layers, hf.config.hidden_size
    ext = build("deepseek-v3", folder / "mtp-src", seed=seed + 100, num_hidden_layers=n + 1)
    torch.manual_seed(seed + 100)
    mtp = _block_like(folder / "mtp-src", n, copy=True)
    mtp.update({"embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
                "enorm.weight": 1 + 0.1 * torch.randn(h), "hnorm.weight": 1 + 0.1 * torch.randn(h),
                "eh_proj.weight": torch.randn(h, 2 * h) * (2 * h) ** -0.5,
                "shared_head.norm.weight": 1 + 0.1 * torch.randn(h),
                "shared_head.head.weight": torch.randn(hf.config.vocab_size, h) * h ** -0.5})
    _write(folder, hf, mtp)
    hf.mtp_reference = (ext, mtp)
    return hf


def reference_drafts(hf, seq: list[int], k: int) -> list[int]:
    """The K greedy drafts after the known tokens `seq`, by full recompute in transformers: the target's final
    hidden states of `seq`, then the MTP block (transformers' DeepseekV3DecoderLayer, causal over the entries
    t = 0 .. len(seq) - 2 and the chain's) with ``eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])`` before it and
    ``shared_head`` after it. Entry t's next h in the chain is ``shared_head.norm``'s output."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    ext, w = hf.mtp_reference
    eps, size = hf.config.rms_norm_eps, hf.config.hidden_size

    def norm(name):
        m = DeepseekV3RMSNorm(size, eps)
        m.weight.data.copy_(w[name])
        return m

    enorm, hnorm, shared = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
    layer = ext.model.layers[hf.config.num_hidden_layers]
    with torch.no_grad():
        hidden = list(hf(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0][:-1])
        tokens = list(seq[1:])
        drafts: list[int] = []
        for _ in range(k):
            e = hf.model.embed_tokens(torch.tensor(tokens))
            x = torch.cat([enorm(e), hnorm(torch.stack(hidden))], dim=-1) @ w["eh_proj.weight"].T
            t = len(tokens)
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            out = layer(x[None], attention_mask=mask, position_ids=pos,
                        position_embeddings=ext.model.rotary_emb(x[None], pos))
            last = shared(out[0, -1])
            drafts.append(int((last @ w["shared_head.head.weight"].T).argmax()))
            tokens.append(drafts[-1])
            hidden.append(last)
    return drafts


def record_drafts(proposer) -> list[tuple[list[int], list[int]]]:
    """Wrap `proposer`'s ``_propose``: the returned list fills with (the request's tokens, its drafts) per draft."""
    orig, seen = proposer._propose, []

    def spy(work):
        out = orig(work)
        seen.extend((list(req.token_ids), out[req.request_id]) for req, _ in work if req.request_id in out)
        return out

    proposer._propose = spy
    return seen


_OUTPUTS = ("o_proj.weight", "down_proj.weight")  # each block's output projections (attention, MLPs, experts)


def echo_mtp(folder: Path, seed: int = 0, scale: float = 1e-3):
    """A target whose blocks barely move the residual stream, and an MTP layer that repeats its head on the
    input token; returns transformers' model of that target."""
    hf = build("deepseek-v3", folder, seed=seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith((*_OUTPUTS, "experts.down_proj")):  # transformers stacks the experts
                p.mul_(scale)
    hf.save_pretrained(folder, max_shard_size="200KB")
    torch.manual_seed(seed + 200)
    n, h = hf.config.num_hidden_layers, hf.config.hidden_size
    mtp = _block_like(folder, n - 1)
    for k in mtp:
        if k.endswith(_OUTPUTS):
            mtp[k] = mtp[k] * scale
    eh = torch.cat([torch.eye(h), scale * torch.randn(h, h) * h ** -0.5], dim=1)
    mtp.update({"embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
                "enorm.weight": torch.ones(h), "hnorm.weight": 1 + 0.1 * torch.randn(h), "eh_proj.weight": eh,
                "shared_head.norm.weight": hf.model.norm.weight.detach().clone(),
                "shared_head.head.weight": hf.lm_head.weight.detach().clone()})
    _write(folder, hf, mtp)
    return hf


def reference_hidden(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) of `ids` [len(ids), hidden], float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
