"""The one error a client can fix: `UserError(field, message)`, a 4xx naming the field;
`check(cond, field, message)` raises it."""

from __future__ import annotations


class UserError(ValueError):
    """A request that can never succeed as sent: a 4xx at submission, or a failed
    future of category `user`. `field` names what to fix; `status` is the HTTP code."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


def check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise UserError(field_name, message)
