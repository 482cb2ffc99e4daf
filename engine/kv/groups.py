"""KV cache groups: layers that share one page rule, one block table per request, and pages of one shared pool.

A model whose layers attend differently (`pd_cluster.engine.layer_attention`) needs different KV per layer: a
``full`` layer reads every earlier token, a ``sliding`` (window W) or ``chunked`` (chunk C) layer only the last W
tokens or its own chunk. Layers with the same page rule form a *group*; each request has one block table per
group, and a windowed group's table holds only the pages its window still needs: pages behind the window are
freed as the window moves and their block-table entries become the null page (vLLM's sliding-window manager,
``SlidingWindowManager.remove_skipped_blocks``).

Page-size unification (vLLM's hybrid allocator, ``kv_cache_utils._get_kv_cache_groups_uniform_page_size``): every
group has at most `layers_per_page` layers, and one page of the single pool holds `layers_per_page` layers of
``page_size`` tokens of *one* group. All groups draw from one `PageAllocator`, so the budget is divided by what
the running requests need at each moment, not by a ratio fixed at start-up (SGLang's SWA pool keeps two pools
with a fixed ``swa_full_tokens_ratio``). A type with more layers than `layers_per_page` gets several groups with
the same rule (Llama 4 Scout: 36 chunked + 12 full layers -> 3 chunked groups and 1 full group of 12 layers).

A *state group* holds the ``linear`` layers (`pd_cluster.engine.layer_attention`: Gated DeltaNet), which keep a
fixed-size recurrent state per request instead of K and V per token: each request holds the same number of
pages of it, ``rule[1]``, from its first step to its release, whatever its length: the bytes of its state
(`pd_cluster.engine.model.linear_config`) laid over those pages in table order (vLLM's hybrid allocator keeps
a Mamba layer's state in one block of the unified pool the same way, ``MambaSpec``). Being pages of the one
pool, states are sized by the memory budget, counted by admission and the page metrics, freed with the request
and moved by a PD transfer as pages are.

Units: tokens and pages; positions count from 0 in the request's sequence. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pd_cluster.engine.layer_attention import LayerAttention


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group.

    Attributes:
        rule: ``("full", 0)``, ``("sliding", W)`` or ``("chunked", C)``: which keys a query at position ``p`` reads
            (`LayerAttention.mask_key`); ``("state", n)``: a state group, whose requests hold ``n`` pages each.
        layers: the model's layer indices in this group, in order; layer ``layers[i]`` is slot ``i`` of a page.
        state_bytes: a state group's bytes of one request's state on this rank (0 until known).
    """

    rule: tuple[str, int]
    layers: tuple[int, ...]
    state_bytes: int = 0  # a state group: the bytes of one request's state on this rank

    @property
    def kind(self) -> str:
        return self.rule[0]

    @property
    def is_windowed(self) -> bool:
        """Pages behind the window are freed (sliding and chunked groups)."""
        return self.kind in ("sliding", "chunked")

    @property
    def is_state(self) -> bool:
        """A state group: a fixed number of pages per request (`rule`), not pages of tokens."""
        return self.kind == "state"

    def table_pages(self, num_tokens: int, page_size: int) -> int:
        """Entries a request's block table of this group has once it holds `num_tokens` tokens: one per page of
        tokens, or the state group's fixed count."""
        return self.rule[1] if self.is_state else -(-num_tokens // page_size)

    def first_visible(self, position: int) -> int:
        """The first key position a query at `position` reads (0 for a full group)."""
        kind, size = self.rule
        if kind == "sliding":
            return max(position - size + 1, 0)
        if kind == "chunked":
            return position - position % size
        return 0

    def first_needed_page(self, next_position: int, page_size: int) -> int:
        """Pages before this index are never read again once the next query is at `next_position`."""
        return self.first_visible(next_position) // page_size if self.is_windowed else 0

    def max_pages(self, num_tokens: int, chunk: int, page_size: int) -> int:
        """The most pages a request of `num_tokens` tokens holds at once in this group when it computes at most
        `chunk` tokens per step: every page for a full group; for a windowed one, the pages of the widest span a
        step reads, ``window - 1 + chunk`` tokens, which may straddle one more page than it fills."""
        whole = self.table_pages(num_tokens, page_size)
        if not self.is_windowed:
            return whole
        span = self.rule[1] - 1 + max(chunk, 1)
        return min(whole, -(-span // page_size) + 1)


@dataclass(frozen=True)
class KVGroups:
    """How a model's layers map onto the pool's pages.

    Attributes:
        groups: the groups, full groups first (so group 0 is a full group whenever the model has one).
        num_layers: the model's layers.
    """

    groups: tuple[KVGroup, ...]
    num_layers: int

    @cached_property
    def layers_per_page(self) -> int:
        """Layer slots of one page (the largest group of K and V; a state group's pages hold bytes)."""
        return max((len(g.layers) for g in self.groups if not g.is_state), default=1)

    @cached_property
    def state_group(self) -> int | None:
        """The index of the state group, None without one."""
        return next((i for i, g in enumerate(self.groups) if g.is_state), None)

    def with_state(self, nbytes: int, page_nbytes: int) -> "KVGroups":
        """These groups with a request's state of `nbytes` bytes over pages of `page_nbytes`: each request holds
        ``ceil(nbytes / page_nbytes)`` pages of the state group."""
        pages = -(-nbytes // page_nbytes)
        return KVGroups(tuple(KVGroup(("state", pages), g.layers, nbytes) if g.is_state else g
                              for g in self.groups), self.num_layers)

    @cached_property
    def group_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layers:
                out[layer] = gi
        return tuple(out)

    @cached_property
    def slot_of_layer(self) -> tuple[int, ...]:
        """Each layer's slot within its group's pages."""
        out = [0] * self.num_layers
        for g in self.groups:
            for slot, layer in enumerate(g.layers):
                out[layer] = slot
        return tuple(out)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def frees_window_pages(self) -> bool:
        """Some group frees pages behind its window."""
        return any(g.is_windowed for g in self.groups)

    @property
    def is_single(self) -> bool:
        """One full group over every layer in order: today's layout, page for page (non-hybrid models)."""
        return (len(self.groups) == 1 and not self.groups[0].is_windowed
                and self.groups[0].layers == tuple(range(self.num_layers)))

    def max_pages(self, num_tokens: int, chunk: int, page_size: int) -> int:
        """Pages a request of `num_tokens` tokens may hold at once, summed over the groups (see
        `KVGroup.max_pages`)."""
        return sum(g.max_pages(num_tokens, chunk, page_size) for g in self.groups)

    def decode_first_pages(self, num_tokens: int, page_size: int) -> tuple[int, ...]:
        """Per group, the first page of a request of `num_tokens` known tokens that its decode reads from its
        first query (at position `num_tokens`) on: 0 for a full group (and a state group, whose pages are all
        read), `KVGroup.first_needed_page` for a windowed one. A group may read none of them (its value is then
        the page count), but the result always keeps the last page in some group of tokens, so a PD transfer has
        a page to carry the first token (only a model whose every layer is chunked, at a chunk boundary, needs
        this)."""
        total = -(-num_tokens // page_size)
        firsts = [g.first_needed_page(num_tokens, page_size) for g in self.groups]
        if min(f for f, g in zip(firsts, self.groups) if not g.is_state) >= total:
            firsts[0] = total - 1
        return tuple(firsts)

    # ---- PD transfer: the state group as one transfer group per page -----------------------------------------
    # A transfer moves prompt pages in order, one slot per group and page (`transfer.ticket.group_slots`); a
    # state group's pages belong to no prompt page and are final only once the whole prompt is computed. So the
    # transfer sees the state group as `rule[1]` groups of one page each, at the prompt's last page: they are
    # pushed with it, after the prompt's last chunk.

    @property
    def num_transfer_groups(self) -> int:
        """Groups as a PD transfer sees them (the state group once per page of it)."""
        return sum(g.rule[1] if g.is_state else 1 for g in self.groups)

    def transfer_tables(self, tables: list[list[int]], num_tokens: int, page_size: int) -> list[list[int]]:
        """A request's block tables (one per group, group 0 first) as the transfer's groups: the state group's
        table becomes one table per page, of the prompt's length (`num_tokens`), that page at its last entry."""
        total = -(-num_tokens // page_size)
        out: list[list[int]] = []
        for g, table in zip(self.groups, tables):
            out.extend([[0] * (total - 1) + [p] for p in table] if g.is_state else [table])
        return out

    def transfer_first_pages(self, num_tokens: int, page_size: int, num_cached_pages: int = 0) -> tuple[int, ...]:
        """Per transfer group, the first prompt page a PD decode receives for a request of `num_tokens` known
        tokens whose first `num_cached_pages` pages its own prefix cache holds: every page from there on for a
        full group; for a windowed group only those its decode reads (`decode_first_pages`); the last for each
        page of the state group (`transfer_tables`).

        Raises:
            ValueError: `num_cached_pages` is not below the prompt's pages.
        """
        total = -(-num_tokens // page_size)
        if not 0 <= num_cached_pages < total:
            raise ValueError(f"{num_cached_pages} cached pages of a {total}-page prompt")
        out: list[int] = []
        for g, f in zip(self.groups, self.decode_first_pages(num_tokens, page_size)):
            out.extend([total - 1] * g.rule[1] if g.is_state else [max(num_cached_pages, f)])
        return tuple(out)

    def signature(self) -> tuple[str, ...]:
        """One string per group, e.g. ``("full:3,7", "chunked(16):0,1,2", "state(2):0,1:5376B")``: its rule and its
        layers (a state group: and its bytes per request on this rank, which differ with the TP size), in pool
        order (`KVLayout.kv_groups`, compared at the KV transfer handshake)."""
        return tuple(f"{g.kind if g.kind == 'full' else f'{g.kind}({g.rule[1]})'}:{','.join(map(str, g.layers))}"
                     + (f":{g.state_bytes}B" if g.is_state else "") for g in self.groups)

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``full x12, chunked(8192) x12 x3 (12 layers a page)``."""
        counts: dict[tuple[str, int], list[int]] = {}
        for g in self.groups:
            counts.setdefault(g.rule, []).append(len(g.layers))
        parts = []
        for (kind, size), sizes in counts.items():
            name = kind if kind == "full" else f"{kind}({size})"
            parts.append(f"{name}: {len(sizes)} group{'s' if len(sizes) > 1 else ''} of {'/'.join(map(str, sizes))}"
                         " layers")
        return f"{'; '.join(parts)}; {self.layers_per_page} layers a page"


def single_group(num_layers: int) -> KVGroups:
    """Every layer in one full group (no page is freed behind a window; a window stays a mask)."""
    return KVGroups((KVGroup(("full", 0), tuple(range(num_layers))),), num_layers)


def plan_kv_groups(layers: tuple[LayerAttention, ...], state_pages: int = 1) -> KVGroups:
    """The groups of a model with these per-layer attention types.

    Layers of one rule are split into groups of at most ``min(layers per rule)`` layers (vLLM's rule: the
    smallest type sets the page's layer count, so no page carries another type's empty slots; a type whose count
    is not a multiple leaves its last group's pages partly unused). Every layer full: `single_group`. The
    ``linear`` layers form one state group, last, of `state_pages` pages a request (`KVGroups.with_state` sets it
    once the state's and the page's sizes are known).
    """
    by_rule: dict[tuple[str, int], list[int]] = {}
    linear = tuple(i for i, spec in enumerate(layers) if spec.kind == "linear")
    for i, spec in enumerate(layers):
        if spec.kind != "linear":
            by_rule.setdefault(spec.mask_key, []).append(i)
    state = (KVGroup(("state", state_pages), linear),) if linear else ()
    if list(by_rule) == [("full", 0)] and not state:
        return single_group(len(layers))
    size = min(len(v) for v in by_rule.values())
    groups: list[KVGroup] = []
    for rule in sorted(by_rule, key=lambda r: (r[0] != "full", r)):
        idx = by_rule[rule]
        groups.extend(KVGroup(rule, tuple(idx[i:i + size])) for i in range(0, len(idx), size))
    return KVGroups(tuple(groups) + state, len(layers))
