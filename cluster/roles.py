"""What an engine replica (or plain worker actor) does: the roles of disaggregated serving."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """A string enum: `Role.PREFILL == "prefill"`, it hashes as its value (so dicts keyed by
    either find both), and it prints as its value in logs, JSON and metric labels."""

    COLOCATED = "colocated"  # prefill and decode in one engine
    PREFILL = "prefill"  # runs prompts, exports their KV
    DECODE = "decode"  # loads a prompt's KV, generates the rest

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, value: str | Role) -> Role:
        """`value` as a Role; ValueError naming the roles otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role must be one of {[r.value for r in cls]}, got {value!r}") from None

    @property
    def pd_role(self) -> str | None:
        """The KV connector's side for this role: the prefill produces KV, the decode consumes
        it; a colocated engine has no connector."""
        return {Role.PREFILL: "producer", Role.DECODE: "consumer"}.get(self)
