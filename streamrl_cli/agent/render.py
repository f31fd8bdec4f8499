"""Environment messages to tokens, one new message at a time, never re-rendering the conversation.

The chat template is applied to the new messages alone, behind a fixed probe conversation
(system, user, assistant) whose rendering is cut off again: what remains is exactly the text the
template puts for the new messages, the generation prompt of the next assistant turn included.
The model's turn that came before is kept as the model produced it; only the template's closing of
that turn is added, as far as the model did not produce it itself (a turn that stopped at
``<|im_end|>`` gets the template's "\\n" after it; one cut at its token budget gets the whole
closing). So earlier tokens are never touched, whatever the template would do to earlier
messages when re-rendered (strip reasoning, re-space, re-tokenize across a boundary).
"""

from __future__ import annotations

from typing import Any

from streamrl_cli.agent.env_host import AgentError

_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class Renderer:
    """Token ids of environment turns, for one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        self.tok = tokenizer
        self.tools = tools or None
        if not getattr(tokenizer, "chat_template", None):
            raise AgentError(
                "agent: the model's tokenizer has no chat template, so observations cannot be rendered as "
                "messages; use a chat model or give the tokenizer a template (tokenizer_config.json)"
            )
        self.probe = _PROBE
        try:
            self.base = self._render(self.probe, generation=False)
        except Exception:  # noqa: BLE001 - templates that refuse a system message
            self.probe = _PROBE[1:]
            self.base = self._render(self.probe, generation=False)
        end = self.base.rindex("A") + 1
        self.closing = self.base[end:]  # what the template puts after an assistant message ("<|im_end|>\n")
        closing_ids = tokenizer.encode(self.closing, add_special_tokens=False) if self.closing else []
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        # Tokens that end a model turn: the template's closing token (first), if special, and EOS.
        ends = [i for i in closing_ids[:1] if i in special] + [tokenizer.eos_token_id]
        self.turn_end_ids = list(dict.fromkeys(i for i in ends if i is not None))

    def _render(self, msgs: list[dict[str, Any]], *, generation: bool) -> str:
        return self.tok.apply_chat_template(
            msgs, tools=self.tools, tokenize=False, add_generation_prompt=generation
        )

    def env_turn(self, messages: list[dict[str, Any]], model_turn: list[int]) -> list[int]:
        """Tokens to append after `model_turn` (as sampled) for `messages`, up to the next model turn."""
        full = self._render([*self.probe, *messages], generation=True)
        if not full.startswith(self.base):
            raise AgentError(
                "agent: the chat template renders the earlier messages differently once a message is added, "
                "so a message cannot be rendered on its own; give the tokenizer a template that appends"
            )
        emitted = self.tok.decode(model_turn[-1:], skip_special_tokens=False) if model_turn else ""
        closing = (
            self.closing[len(emitted) :] if emitted and self.closing.startswith(emitted) else self.closing
        )
        if model_turn and model_turn[-1] == self.tok.eos_token_id and emitted not in self.closing:
            closing = self.closing  # stopped at EOS, not at the template's own end of turn
        return self.tok.encode(closing + full[len(self.base) :], add_special_tokens=False)

    def first_turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """Tokens after the task's prompt, before the model's first turn: the reset's messages and
        the generation prompt of the first assistant turn. (In an agentic run the task's prompt is
        the conversation's opening without a generation prompt, so the environment can add messages
        after it; with none, this is just the generation prompt.)"""
        opening = [m for m in self.probe if m["role"] != "assistant"]
        head = self._render(opening, generation=False)
        full = self._render([*opening, *messages], generation=True)
        if not full.startswith(head):
            raise AgentError(
                "agent: the chat template renders the earlier messages differently once a message is added, "
                "so a message cannot be rendered on its own; give the tokenizer a template that appends"
            )
        return self.tok.encode(full[len(head) :], add_special_tokens=False)

    def text(self, token_ids: list[int]) -> str:
        """A model turn as text for the environment (its closing token left out)."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.turn_end_ids else token_ids
        return self.tok.decode(ids, skip_special_tokens=False)
