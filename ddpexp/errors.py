"""The one exception type for mistakes a user can make and fix."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """A problem with the user's input or environment: shown as one line plus the fix, exit code 2.

    `setting` names the config key (or thing) at fault; `fix` says what to do about it.
    """

    exit_code = 2

    def __init__(self, message: str, *, setting: str | None = None, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.setting = setting
        self.fix = fix

    def __str__(self) -> str:
        head = f"{self.setting}: {self.message}" if self.setting else self.message
        return f"{head} (fix: {self.fix})" if self.fix else head


def interrupted_within(exc: BaseException) -> bool:
    """Whether a Ctrl-C is behind this error: raised while a KeyboardInterrupt unwound (a library's
    `finally` failing on the state the interrupt left), anywhere down its chain of causes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class NothingToDo(Exception):
    """The command asks for nothing that is not done already (resume=auto on a completed run): said
    plainly, exit code 0."""


def require_positive(required: dict[str, Any], optional: dict[str, Any] | None = None) -> None:
    """Every setting in `required`, and every non-null one in `optional`, must be > 0."""
    values = {**required, **{k: v for k, v in (optional or {}).items() if v is not None}}
    for key, value in values.items():
        if value <= 0:
            raise UserError(f"must be positive, got {value}", setting=key, fix=f"set {key} to a value > 0")
