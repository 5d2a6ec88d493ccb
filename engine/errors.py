"""The one error type every validation failure travels in, from any layer to the user.

A `ParameterError` is a ValueError (offline users catch what they always caught) that also
carries the name of the offending field, so the HTTP layer maps it to OpenAI's `param`
directly instead of reading it out of the message.
"""

from __future__ import annotations


class ParameterError(ValueError):
    """An invalid parameter. `field` is the user-facing name of the field (a SamplingParams
    or EngineArgs field, `prompt`, ...); the message names it and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_int(field: str, value: object, minimum: int = 1, maximum: int | None = None) -> None:
    """Raise unless `value` is an int (not a bool) in [minimum, maximum]."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ParameterError(field, f"{field} must be an integer {bound}, got {value!r}")


def check_number(field: str, value: object) -> None:
    """Raise unless `value` is a real number (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ParameterError(field, f"{field} must be a number, got {value!r}")


def check_choice(field: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ParameterError(field, f"{field} must be one of {choices}, got {value!r}")


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a worker rank died or stopped answering); the message
    says which rank and why. Every later call fails the same way; shut the engine down."""
