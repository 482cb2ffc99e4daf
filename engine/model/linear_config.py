"""The shape of a model's linear-attention layers (Gated DeltaNet) and of the recurrent state each keeps.

A linear-attention layer keeps, per request, a fixed-size state instead of K and V per token: the last
``conv_kernel - 1`` inputs of its causal depthwise convolution (``conv_dim`` channels) and the delta rule's
matrix state, ``[num_v_heads, k_head_dim, v_head_dim]`` (Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", 2024). Both are kept in float32 (`STATE_DTYPE_BYTES`), whatever the model's
dtype, as transformers' reference computes the delta rule. Under tensor parallelism each rank holds
``num_k_heads / tp`` key heads and ``num_v_heads / tp`` value heads, and their channels. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

STATE_DTYPE_BYTES = 4  # float32


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet's sizes (transformers' ``linear_*`` config keys).

    Attributes:
        num_k_heads, num_v_heads: query/key heads and value heads (each key head serves
            ``num_v_heads / num_k_heads`` consecutive value heads).
        k_head_dim, v_head_dim: their widths.
        conv_kernel: the causal convolution's width (``linear_conv_kernel_dim``).

    Raises:
        ValueError: value heads not a multiple of key heads, or a size below 1.
    """

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim, self.conv_kernel) < 1:
            raise ValueError(f"linear attention sizes must be >= 1: {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")

    def conv_dim(self, tp_size: int = 1) -> int:
        """Channels of the convolution on one rank: q, k (``num_k_heads * k_head_dim`` each) and v."""
        return (2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim) // tp_size

    def conv_state_floats(self, tp_size: int = 1) -> int:
        return self.conv_dim(tp_size) * (self.conv_kernel - 1)

    def ssm_state_floats(self, tp_size: int = 1) -> int:
        return self.num_v_heads // tp_size * self.k_head_dim * self.v_head_dim

    def state_floats(self, tp_size: int = 1) -> int:
        """float32 values of one layer's state on one rank: the convolution's, then the delta rule's."""
        return self.conv_state_floats(tp_size) + self.ssm_state_floats(tp_size)

    def state_bytes(self, num_layers: int, tp_size: int = 1) -> int:
        """Bytes of one request's state over `num_layers` linear layers on one rank."""
        return num_layers * self.state_floats(tp_size) * STATE_DTYPE_BYTES

    def num_params(self, hidden_size: int) -> int:
        """Parameters of one layer: the qkvz and ba projections, the convolution, dt bias and A, the gated
        norm and the output projection."""
        key, value = self.num_k_heads * self.k_head_dim, self.num_v_heads * self.v_head_dim
        return (hidden_size * (2 * key + 2 * value) + hidden_size * 2 * self.num_v_heads
                + (2 * key + value) * self.conv_kernel + 2 * self.num_v_heads + self.v_head_dim + value * hidden_size)

    def check_tp(self, tp_size: int) -> None:
        """Raises ValueError: `tp_size` does not divide the key heads."""
        if self.num_k_heads % tp_size:
            raise ValueError(f"--tp-size {tp_size} must divide linear_num_key_heads ({self.num_k_heads})")
