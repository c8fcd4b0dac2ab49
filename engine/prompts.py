"""A user's prompt (after earlier chat turns) as chat messages or token ids. No torch: the HTTP backends send the
messages to their servers."""

from __future__ import annotations


def chat_messages(text: str, earlier_turns=()) -> list[dict]:
    return [{"role": role, "content": content} for role, content in earlier_turns] + [{"role": "user", "content": text}]


def encode_prompt(tokenizer, text: str, chat: bool = True, earlier_turns=()) -> list[int]:
    """Token ids of a user prompt (after earlier chat turns, if any); chat models get their chat template, with
    the assistant turn opened."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(chat_messages(text, earlier_turns), tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n".join([c for _, c in earlier_turns] + [text]))["input_ids"]
