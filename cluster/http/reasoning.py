"""Reasoning parsers (vLLM's `--reasoning-parser`, docs/tools.md#reasoning): a reasoning model's
answer split into its thinking (`<think>...</think>`), returned as `reasoning_content`, and the
answer proper, returned as `content` (and parsed for tool calls after the split).

Two conventions, under vLLM's names:
- `deepseek_r1`: the chat template opens `<think>` itself, so the model's text starts inside
  the reasoning; everything up to `</think>` is reasoning (a leading `<think>` is dropped), and
  an answer that never closes it is all reasoning.
- `qwen3`: the model writes `<think>` itself, or not at all (`enable_thinking: false` in
  `chat_template_kwargs`): text before a `<think>` and without one is all content.

Streaming holds back any text that may be the start of a tag, so a tag split across deltas is
never shown; the streamed pieces always add up to the whole split.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the template opened <think>: the text begins as reasoning
    end: str = END

    def thinks_after(self, prompt_text: str) -> bool:
        """Whether a model given this prompt thinks first: not when the template closed the
        thinking itself (Qwen3's `enable_thinking: false` ends the prompt with an empty
        `<think></think>`)."""
        return not prompt_text.rstrip().endswith(END)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for a part that is absent."""
        stream = self.stream()
        parts = stream.feed(text) + stream.finish()
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        content = "".join(t for kind, t in parts if kind == "content")
        return (reasoning if stream.reasoned else None), (content or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_inside)


class ReasoningStream:
    """One answer's deltas as ("reasoning" | "content", text) pieces."""

    def __init__(self, starts_inside: bool) -> None:
        # "open": before anything (a leading <think> may come); "think": inside; "answer": after.
        self.state = "open"
        self.starts_inside = starts_inside
        self.reasoned = False  # whether any reasoning was seen (an empty <think></think> counts)
        self._held = ""

    def feed(self, delta: str) -> list[tuple[str, str]]:
        text, self._held = self._held + delta, ""
        out: list[tuple[str, str]] = []
        while text:
            if self.state == "open":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.state, self.reasoned, text = "think", True, stripped[len(START):]
                    continue
                if START.startswith(stripped):  # maybe a tag still arriving (or only spaces)
                    self._held = text
                    break
                if self.starts_inside:
                    self.state, self.reasoned = "think", True
                else:
                    self.state = "answer"
                continue
            if self.state == "answer":
                out.append(("content", text))
                break
            at = text.find(END)
            if at >= 0:
                if at:
                    out.append(("reasoning", text[:at]))
                self.state, text = "answer", text[at + len(END):]
                continue
            keep = _partial_tail(text, END)
            if len(text) > keep:
                out.append(("reasoning", text[:len(text) - keep]))
            self._held = text[len(text) - keep:]
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the answer ended: a tag that never completed is text."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self.state == "open":
            if self.starts_inside:
                self.reasoned = True
                return [("reasoning", held)]
            return [("content", held)]
        return [("reasoning" if self.state == "think" else "content", held)]


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may be the tag arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, "
                         f"got {name!r}") from None
