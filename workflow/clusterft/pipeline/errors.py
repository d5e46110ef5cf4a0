"""Errors a user can cause (bad data, bad config, missing files)."""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input. The message names the file, the record/line and the field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        where = []
        if path is not None:
            where.append(str(path))
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field '{field}'")
        prefix = ": ".join([", ".join(where)]) + ": " if where else ""
        super().__init__(prefix + message)
        self.path, self.line, self.field = path, line, field
        self.message = message
