"""session.truncation at work: fitting a response's prompt to the thinker's context by taking the
oldest conversation items out of the model's context (events.Truncation says what the client sets).

The gateway learns the thinker's context the way it learns it for every API: a request past it is
refused OUT_OF_RANGE, and the refusal carries its numbers (stages.proto ContextExceeded: the
prompt, the reply's room, the context). A session keeps what it learned (ContextRoom) and checks
each later prompt before sending it; a refusal that still comes (another replica, another reply
budget) is learned from and the response is fitted once more.

A cut is a number of leading turns left out, at an item that can begin a conversation (not a
function's result, not an item with nothing left in it); the instructions and tools are never
cut, nor the newest item. The kept conversation is the longest one of at most `retention_ratio`
times the room after the instructions, so the turns after a cut append to a prefix the thinker's
prefix cache holds until the conversation fills the context again. The items cut stay in the
conversation (conversation.item.retrieve still returns them; no event is sent, as OpenAI's API
sends none): they are only no longer in the model's context, which the next response.done's
usage.input_tokens shows."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from voxpipe.services.thinker.prompt import ChatMessage, RenderedPrompt
from voxpipe.v1 import stages_pb2 as pb

from ..errors import APIError
from .events import Truncation
from .session import prompt_messages

Turns = tuple[tuple[str, ChatMessage | None], ...]


@dataclass(frozen=True)
class PromptWindow:
    """What a response's prompt is made of, as it was when the response was created: the
    instructions and the (item id, turn) of each item in the model's context; `drop(ids)` takes
    items out of the session's context (Conversation.drop)."""

    instructions: str
    turns: Turns
    drop: Callable[[Sequence[str]], None] = field(default=lambda ids: None)

    def messages(self, cut: int = 0) -> list[ChatMessage]:
        return prompt_messages(self.instructions, self.turns[cut:])

    def cuts(self) -> list[int]:
        """The cuts (turns left out) that leave a conversation beginning at a user or assistant turn."""
        return [k for k in range(1, len(self.turns))
                if self.turns[k][1] is not None and self.turns[k][1].role != "tool"]


@dataclass
class ContextRoom:
    """What a session has learned of the thinker's context from its refusals (0: not yet)."""

    context_tokens: int = 0
    default_reply_tokens: int = 0       # the reply's room of a request without max_tokens (the thinker's default)

    def learn(self, refused: pb.ContextExceeded, max_tokens_sent: int) -> None:
        self.context_tokens = refused.context_tokens
        if not max_tokens_sent:
            self.default_reply_tokens = refused.reply_tokens

    def prompt_limit(self, max_tokens: int) -> int | None:
        """The most prompt tokens a reply of `max_tokens` (0: the thinker's default) leaves room
        for, None while that is not known."""
        reply = max_tokens or self.default_reply_tokens
        if not self.context_tokens or not reply:
            return None
        return self.context_tokens - reply


class ContextTooLong(Exception):
    """The prompt does not fit and truncation cannot (or may not) make it fit."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.error = APIError(400, message, code="context_length_exceeded")


Render = Callable[[list[ChatMessage]], Awaitable[RenderedPrompt]]


@dataclass(frozen=True)
class Fitted:
    prompt: RenderedPrompt
    cut: int                          # leading turns left out


def _post_instructions(prompt: RenderedPrompt, has_system: bool, turn_start: int) -> int:
    """The prompt's tokens after its system turn (instructions and tools): from its second turn on."""
    if not has_system:
        return len(prompt.token_ids)
    starts = [i for i, t in enumerate(prompt.token_ids) if t == turn_start]
    return len(prompt.token_ids) - (starts[1] if len(starts) > 1 else len(prompt.token_ids))


async def fit(render: Render, window: PromptWindow, truncation: Truncation, prompt_limit: int | None,
              has_system: bool, turn_start: int) -> Fitted:
    """The prompt of `window` that fits `prompt_limit` tokens (None: not known, the whole prompt)
    and the truncation's post_instructions, cutting as the module says. `has_system`: the prompt
    has a system turn (instructions or tools); `turn_start`: the <|im_start|> token id. Raises
    ContextTooLong."""
    prompt = await render(window.messages())
    post_limit = truncation.post_instructions
    if prompt_limit is None and post_limit is None:
        return Fitted(prompt, 0)
    n = len(prompt.token_ids)
    post = _post_instructions(prompt, has_system, turn_start)
    base = n - post                                           # the system turn's tokens
    room = post_limit if prompt_limit is None else min(prompt_limit - base, post_limit or math.inf)
    if post <= room:
        return Fitted(prompt, 0)
    over = (f"the prompt of {n} tokens (instructions and tools {base}, the conversation {post}) does not fit "
            + (f"the thinker's context: {prompt_limit} tokens with room for the reply"
               if prompt_limit is not None and n > prompt_limit
               else f"session.truncation.token_limits.post_instructions {post_limit}"))
    if truncation.mode == "disabled":
        raise ContextTooLong(f"{over}, and session.truncation is \"disabled\"")
    cuts = window.cuts()
    target = math.floor(truncation.retention_ratio * room)

    async def tail(k: int) -> tuple[RenderedPrompt, int]:
        p = await render(window.messages(k))
        return p, _post_instructions(p, has_system, turn_start)

    if not cuts:
        raise ContextTooLong(f"{over}, and the newest item alone is the conversation")
    shortest, shortest_post = await tail(cuts[-1])
    if shortest_post > room:
        raise ContextTooLong(f"{over}; the newest item alone makes {shortest_post} tokens of conversation, "
                             f"more than the {max(room, 0)} that fit")
    best, best_prompt = cuts[-1], shortest
    if shortest_post <= target:          # the fewest turns cut that keep at most `target`
        lo, hi = 0, len(cuts) - 1         # cuts[hi] keeps at most `target`; the cuts before cuts[lo] keep more
        while lo < hi:
            mid = (lo + hi) // 2
            p, p_post = await tail(cuts[mid])
            if p_post <= target:
                hi, best_prompt = mid, p
            else:
                lo = mid + 1
        best = cuts[hi]                   # (best_prompt is always cuts[hi]'s)
    return Fitted(best_prompt, best)
