"""EPLB's flags (`EPLBConfig`), apart from `pd_cluster.engine.model.eplb` so that reading engine flags (``pd-serve``,
``pd-plan``, the router's launcher) does not import torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EPLBConfig:
    """``--ep-num-redundant-experts`` (extra physical experts over the EP group, a multiple of its size),
    ``--enable-eplb`` (rebalance from the recorded load) and ``--eplb-rebalance-num-iterations`` (steps between
    two rebalances)."""

    num_redundant_experts: int = 0
    enable: bool = False
    rebalance_num_iterations: int | None = None  # None: 1000 (SGLang's default)

    @property
    def every(self) -> int:
        """Steps between two rebalances."""
        return self.rebalance_num_iterations or 1000

    @property
    def active(self) -> bool:
        return self.num_redundant_experts > 0 or self.enable

    def check(self, expert_parallel: bool, context_parallel: bool = False) -> None:
        """Refuse settings that cannot run (naming the flag); expert parallelism over several ranks is checked
        where the ranks are known (`LLMEngine`, `setup_eplb`).

        Raises:
            ValueError: a negative count, no steps between rebalances, a rebalance period without
                ``--enable-eplb``, EPLB without expert parallelism or with context-parallel prefill.
        """
        if self.num_redundant_experts < 0:
            raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {self.num_redundant_experts}")
        if self.rebalance_num_iterations is not None and self.rebalance_num_iterations < 1:
            raise ValueError(f"--eplb-rebalance-num-iterations must be >= 1, got {self.rebalance_num_iterations}")
        if self.rebalance_num_iterations is not None and not self.enable:
            raise ValueError("--eplb-rebalance-num-iterations needs --enable-eplb (without it nothing rebalances)")
        if self.active and context_parallel:
            raise ValueError(f"{self.flags} with --prefill-context-parallel-size is not built (each context-parallel "
                             "rank holds every expert)")
        if self.active and not expert_parallel:
            raise ValueError(f"{self.flags} need expert parallelism over several ranks (--enable-expert-parallel "
                             "with --tp-size > 1)")

    @property
    def flags(self) -> str:
        """The EPLB flags set, for messages."""
        return " and ".join(f for f, on in (("--ep-num-redundant-experts", self.num_redundant_experts > 0),
                                            ("--enable-eplb", self.enable)) if on)
