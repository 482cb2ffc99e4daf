"""Reading the CSV traces: the columns a dataset needs, checked up front with a one-line error."""

from __future__ import annotations

import csv


def read_csv(path: str, columns: tuple[str, ...], dataset: str, limit: int | None = None,
             keep=None) -> list[dict[str, str]]:
    """The rows of a CSV trace (the first ``limit`` that ``keep(row)`` accepts, in file order).

    Raises:
        ValueError: a needed column is missing (one line naming the column, the columns found,
            and the dataset whose columns they look like), or the file has no header.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        found = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in columns if c not in found]
        if missing:
            raise ValueError(f"{path}: --dataset-name {dataset} needs the column {missing[0]!r}, which the "
                             f"file lacks (its columns: {', '.join(found) or 'none'}){_hint(found, dataset)}")
        rows = []
        for row in reader:
            row = {(k or "").strip(): v for k, v in row.items()}
            if keep is None or keep(row):
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    return rows


SHAPES = {
    "azure-trace": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}


def _hint(found: list[str], dataset: str) -> str:
    for name, cols in SHAPES.items():
        if name != dataset and all(c in found for c in cols):
            return f"; it looks like a {name} file: use --dataset-name {name}"
    return ""


def number(row: dict[str, str], column: str, path: str, cast=int):
    """``cast(row[column])``. Raises ``ValueError`` naming the file, the column and the value."""
    text = (row.get(column) or "").strip()
    try:
        return cast(float(text)) if cast is int else cast(text)
    except ValueError:
        raise ValueError(f"{path}: column {column!r}: not a number: {text!r}") from None
