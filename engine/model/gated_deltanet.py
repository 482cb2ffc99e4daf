"""Gated DeltaNet: a linear-attention layer with a fixed-size recurrent state per request (Qwen3-Next's
``linear_attention`` layers).

Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR 2025). Per value head,
the state ``S`` [k_head_dim, v_head_dim] is updated by each token ``t`` as

    S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

with ``q`` and ``k`` L2-normalised and ``q`` scaled by ``k_head_dim ** -0.5``, ``beta = sigmoid(b)`` and the
decay ``g = -exp(A_log) softplus(a + dt_bias)``. q, k and v first go through a causal depthwise convolution
(width ``conv_kernel``, SiLU), whose last ``conv_kernel - 1`` inputs are kept too. The output is RMS-normed per
head, multiplied by ``silu(z)`` (a gate projected from the input) and projected back.

A prefill chunk is computed in blocks of `CHUNK` tokens (the delta rule's chunked form: within a block the
updates are one unit-lower-triangular solve, the WY representation of DeltaNet, Yang et al. 2024); a decode token
by the recurrence. A request's state is read at the start of each step from its state pages
(`pd_cluster.engine.kv.pool.KVPool.read_states`) and written back after it; a request whose step starts at
position 0 starts from zeros, so a freshly allocated (or recomputed) request never reads another's state.

Checkpoint names as in transformers' ``Qwen3NextGatedDeltaNet``: ``in_proj_qkvz`` (per key head: q, k, then
its value heads' v and z), ``in_proj_ba`` (per key head: its value heads' b, then a), ``conv1d`` (channels q, k,
v), ``dt_bias``, ``A_log``, ``norm`` and ``out_proj``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

CHUNK = 64  # tokens per block of the chunked delta rule


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one request's tokens, `chunk` at a time.

    Args:
        q, k: [H, n, Dk] float32 (normalised and scaled); v: [H, n, Dv]; g (log decay), beta: [H, n].
        state: [H, Dk, Dv] float32, the state before the first token.

    Returns:
        (outputs [H, n, Dv], the state after the last token [H, Dk, Dv]), float32.
    """
    outs = []
    for s in range(0, q.shape[1], chunk):
        qc, kc, vc, bc = q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk], beta[:, s:s + chunk]
        cum = g[:, s:s + chunk].cumsum(-1)  # [H, L]
        n = cum.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, L, L]
        strict = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(strict + torch.eye(n, device=q.device), rhs, upper=False,
                                          unitriangular=True)  # [H, L, Dv]
        outs.append(cum.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        last = cum[:, -1:]
        state = last.exp()[..., None] * state + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outs, dim=1), state


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv]
    (float32). Returns (outputs [B, H, Dv], new states)."""
    state = state * g.exp()[..., None, None]
    delta = beta[..., None] * (v - (state * k[..., None]).sum(-2))
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, ``weight * round(x_normed)``, multiplied by ``silu(z)`` in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (module docstring). Under TP each rank holds ``1 / tp`` of the key and value
    heads; `out_proj` ends with an all-reduce.

    Args:
        cfg: the architecture (``cfg.linear``: `LinearAttentionConfig`).
        layer: the model's layer index.
        index: the layer's place among the linear layers (its state's place in a request's state).
    """

    def __init__(self, cfg: ArchConfig, layer: int, index: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        lc = cfg.linear
        self.layer, self.index, self.tp = layer, index, tp
        self.hk, self.hv = lc.num_k_heads // tp.size, lc.num_v_heads // tp.size
        self.dk, self.dv, self.kernel = lc.k_head_dim, lc.v_head_dim, lc.conv_kernel
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.state_floats = lc.state_floats(tp.size)
        self.in_proj_qkvz = make_linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = make_linear(cfg.hidden_size, 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = make_linear(self.value_dim, cfg.hidden_size, bias=False)

    @staticmethod
    def checkpoint_tensor(cfg: ArchConfig, tp: TPGroup, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (whole: the loader does not split these): its key heads'
        rows of ``in_proj_qkvz`` and ``in_proj_ba`` (each key head's rows are together), its channels of each of
        q, k and v in ``conv1d``, its value heads of ``dt_bias`` and ``A_log`` and columns of ``out_proj``; the
        norm whole."""
        if tp.size == 1 or name.endswith("norm.weight"):
            return tensor
        if name.endswith("conv1d.weight"):
            lc = cfg.linear
            key, value = lc.num_k_heads * lc.k_head_dim, lc.num_v_heads * lc.v_head_dim
            return torch.cat([part.chunk(tp.size)[tp.rank] for part in tensor.split([key, key, value])])
        if name.endswith("out_proj.weight"):
            return tensor.chunk(tp.size, dim=1)[tp.rank]
        return tensor.chunk(tp.size)[tp.rank]

    def _states(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's views of the step's states [B, total floats]: conv [B, C, K - 1], delta [B, Hv, Dk, Dv]."""
        mine = states[:, self.index * self.state_floats:(self.index + 1) * self.state_floats]
        conv = mine[:, :self.conv_dim * (self.kernel - 1)].view(-1, self.conv_dim, self.kernel - 1)
        return conv, mine[:, self.conv_dim * (self.kernel - 1):].view(-1, self.hv, self.dk, self.dv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `states` [B, floats] float32, this step's states of its requests,
        updated in place."""
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(-1, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(-1, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(-1, self.key_dim), k.reshape(-1, self.key_dim),
                           v.reshape(-1, self.value_dim)], dim=-1)
        conv_state, ssm_state = self._states(states)
        starts = [s - n for s, n in zip(batch.seq_lens_cpu, batch.query_lens_cpu)]
        fresh = torch.tensor([s == 0 for s in starts], device=x.device)
        conv_state.masked_fill_(fresh[:, None, None], 0.0)
        ssm_state.masked_fill_(fresh[:, None, None, None], 0.0)
        mixed = self._conv(mixed, batch, conv_state)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.reshape(-1, self.hv)).float()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(-1, self.hv).float() + self.dt_bias)
        q = _l2norm(q.reshape(-1, self.hk, self.dk).float().repeat_interleave(r, dim=1)) * self.dk ** -0.5
        k = _l2norm(k.reshape(-1, self.hk, self.dk).float().repeat_interleave(r, dim=1))
        out = self._delta_rule(q, k, v.reshape(-1, self.hv, self.dv).float(), g, beta, batch, ssm_state)
        out = self.norm(out.to(x.dtype), z.reshape(-1, self.hv, self.dv)).reshape(-1, self.value_dim)
        return self.tp.all_reduce(self.out_proj(out)) if self.tp.size > 1 else self.out_proj(out)

    def _conv(self, mixed: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution and SiLU of each request's tokens [T, C], after its kept inputs;
        `conv_state` [B, C, K - 1] becomes each request's last K - 1 inputs."""
        w = self.conv1d.weight  # [C, 1, K]
        out = torch.empty_like(mixed)
        nd, qsl = batch.num_decodes, batch.query_start_loc_cpu
        if nd:
            ext = torch.cat([conv_state[:nd].to(mixed.dtype), mixed[:nd, :, None]], dim=-1)  # [nd, C, K]
            out[:nd] = (ext * w[:, 0]).sum(-1)
            conv_state[:nd] = ext[..., 1:].float()
        for i in range(nd, batch.num_reqs):
            s, e = qsl[i], qsl[i + 1]
            ext = torch.cat([conv_state[i].to(mixed.dtype), mixed[s:e].t()], dim=-1)  # [C, K - 1 + n]
            out[s:e] = F.conv1d(ext[None], w, groups=self.conv_dim)[0].t()
            conv_state[i] = ext[:, ext.shape[1] - (self.kernel - 1):].float()
        return F.silu(out)

    def _delta_rule(self, q, k, v, g, beta, batch: ForwardBatch, ssm_state: torch.Tensor) -> torch.Tensor:
        """Outputs [T, Hv, Dv] float32: decodes by one recurrence step together, prefill chunks one by one."""
        out = torch.empty_like(v)
        nd, qsl = batch.num_decodes, batch.query_start_loc_cpu
        if nd:
            out[:nd], ssm_state[:nd] = delta_rule_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], ssm_state[:nd])
        for i in range(nd, batch.num_reqs):
            s, e = qsl[i], qsl[i + 1]
            o, ssm_state[i] = delta_rule_chunked(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                 v[s:e].transpose(0, 1), g[s:e].t(), beta[s:e].t(), ssm_state[i])
            out[s:e] = o.transpose(0, 1)
        return out
