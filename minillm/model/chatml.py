"""SmolLM2's chat template, rendered in plain Python (lesson 00).

An instruct model was tuned on conversations laid out one way, so a prompt must be laid out the
same way. SmolLM2 uses ChatML: every turn is `<|im_start|>` + role + newline + content +
`<|im_end|>` + newline, where `<|im_start|>` and `<|im_end|>` are single special tokens
(ids 1 and 2; `<|im_end|>` is also the EOS the model emits when its turn is over). A
conversation that does not open with a system turn gets SmolLM2's default one, and
`add_generation_prompt` ends the text with the assistant's header, so the model's next tokens
are the reply.

The checkpoint ships this as a Jinja template (`SMOLLM2_CHAT_TEMPLATE`, verbatim);
`render_chatml` is that template written out, equal to transformers' `apply_chat_template` on
it (tests/test_00_tokenization.py). The tokenizers of `minillm.model.tokenizer` render with it
whenever their template is this one, and with Jinja otherwise.
"""

from __future__ import annotations

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def renders_as_chatml(template: str | None, messages: list[dict]) -> bool:
    """Whether `render_chatml` gives exactly what Jinja would: SmolLM2's template, and turns whose role and
    content are strings (Jinja's `+` refuses other types; Python's formatting would not)."""
    return template == SMOLLM2_CHAT_TEMPLATE and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def render_chatml(messages: list[dict], add_generation_prompt: bool = True,
                  default_system: str = SMOLLM2_DEFAULT_SYSTEM) -> str:
    """The conversation as SmolLM2 was tuned to read it.

    messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]; other keys are ignored.
    """
    turns = []
    if messages and messages[0]["role"] != "system":
        turns.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for message in messages:
        turns.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    if add_generation_prompt:
        turns.append("<|im_start|>assistant\n")
    return "".join(turns)
