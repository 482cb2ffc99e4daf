"""One way to turn command-line flags into frozen configs: a table of `Flag` rows.

The engine (`pd_cluster.engine.args`), the KV transfer (`pd_cluster.transfer.config`) and the router
(`pd_cluster.router.args`) each declare their flags as one tuple of `Flag` and use the same three calls:

* `add_flags(parser, flags, defaults)` adds them to an argparse parser; with `defaults` (a config instance)
  each flag's default is read from the config's field, so a default is written once, in the dataclass;
* `flag_values(ns, flags)` reads the parsed values back as ``{field: value}``, ready for the config;
* `Refused` rows name a spelling of another server (vLLM, SGLang) whose meaning differs from ours: argparse
  stops with a one-line error that names the flag to use instead.

No third-party import (`pd_cluster.common`): the router, the transfer and `pd-bench` import this without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the config field it sets.

    Attributes:
        name: the flag (``--page-size``); its argparse ``dest`` is the name without dashes, ``_`` for ``-``.
        field: the config field it sets; a dotted ``section.field`` where the config has sections.
        type: converts the text (None with an ``action``).
        help: one line for ``--help``.
        action: an argparse action (``store_true``, ``argparse.BooleanOptionalAction``), else a value.
        choices: the accepted values, if closed.
        aliases: other spellings with the same meaning (vLLM's or SGLang's), e.g. ``("--model-path",)``.
        nargs: argparse's ``nargs`` (``"+"`` for lists).
    """

    name: str
    field: str
    type: Callable[[str], Any] | None
    help: str | None
    action: str | type | None = None
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()
    nargs: str | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def section(self) -> str | None:
        """``cache`` for ``cache.page_size``; None for a plain field."""
        return self.field.rpartition(".")[0] or None

    @property
    def attr(self) -> str:
        """The field's own name (``page_size`` for ``cache.page_size``)."""
        return self.field.rpartition(".")[2]


@dataclass(frozen=True)
class Refused:
    """A spelling of another server that pd-cluster refuses because its meaning differs from ours.

    Attributes:
        name: the other server's flag (``--gpu-memory-utilization``).
        reason: one line: what differs and which of our flags to use.
    """

    name: str
    reason: str


class _RefuseAction(argparse.Action):
    def __init__(self, option_strings, dest, reason: str = "", **kwargs) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not supported: {self.reason}")


def is_refusal(action: argparse.Action) -> bool:
    """True for the actions `add_flags` made from `Refused` rows (they set nothing)."""
    return isinstance(action, _RefuseAction)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[Flag | Refused],
              defaults: object | None = None) -> None:
    """Add `flags` to `parser` (or an argument group).

    Args:
        defaults: a config instance whose fields give the defaults (``getattr(defaults, flag.attr)``, sections
            followed for dotted fields); None: every default is None, meaning "the config's default applies".
    """
    for f in flags:
        if isinstance(f, Refused):
            parser.add_argument(f.name, action=_RefuseAction, reason=f.reason, help=argparse.SUPPRESS)
            continue
        kwargs: dict[str, Any] = {"dest": f.dest, "help": f.help, "default": _default(defaults, f.field)}
        if f.action is not None:
            kwargs["action"] = f.action
        else:
            kwargs["type"] = f.type
        if f.choices:
            kwargs["choices"] = f.choices
        if f.nargs:
            kwargs["nargs"] = f.nargs
        parser.add_argument(f.name, *f.aliases, **kwargs)


def flag_values(ns: argparse.Namespace, flags: Iterable[Flag | Refused], skip_none: bool = True,
                section: str | None = None) -> dict[str, Any]:
    """``{field: value}`` of `flags` in a parsed namespace.

    Args:
        skip_none: leave out flags that are None (their config default applies).
        section: only the flags of this section, keyed by their own field name (``page_size``).
    """
    out: dict[str, Any] = {}
    for f in flags:
        if isinstance(f, Refused) or (section is not None and f.section != section):
            continue
        value = getattr(ns, f.dest, None)
        if value is None and skip_none:
            continue
        out[f.attr if section is not None else f.field] = value
    return out


def option_names(flags: Sequence[Flag | Refused]) -> list[str]:
    """Every spelling the table accepts (names and aliases), refused ones excluded."""
    return [n for f in flags if isinstance(f, Flag) for n in (f.name, *f.aliases)]


def _default(defaults: object | None, field: str) -> Any:
    if defaults is None:
        return None
    value: Any = defaults
    for part in field.split("."):
        value = getattr(value, part)
    return value
