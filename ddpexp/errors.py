"""The one exception type for mistakes a user can make and fix."""

from __future__ import annotations


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
