"""OpenAI tool calls as structured output: the tools in the prompt, the call constrained, the reply parsed back.

A request's `tools` are functions, each with a JSON schema for its parameters. Models tuned for tool
use have their own markup in their chat template; SmolLM2's has none, so, as llama.cpp's server does
for such templates (its "generic" format), the tools are described in the system turn and the model
is asked to answer either in text or with one JSON object `{"name": ..., "arguments": {...}}`. What
makes the call valid is lesson 18's automaton, not the model's obedience:

    tool_choice "none"       the tools are not offered; the reply is text
    tool_choice "auto"       text, or a call: a reply that begins with "{" must be a whole call
                             (the default with tools; llama.cpp's lazy grammars trigger the same way)
    tool_choice "required"   a call to one of the tools (anyOf over them)
    {"type": "function", "function": {"name": N}}   a call to N

A call's arguments are constrained by its tool's `parameters` schema, within lesson 18's subset (a
keyword outside it is a 400 naming it). A reply that is a call comes back as `message.tool_calls`
with finish_reason "tool_calls" (streamed as one delta once the call is whole). The conversation's
later turns go back into the prompt as ChatML turns: an assistant turn with `tool_calls` as the call's
JSON, a `tool` turn (the result) under its own role.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .openai_api import APIError

AUTO, REQUIRED, NONE = "auto", "required", "none"
INSTRUCTIONS = ("You can call the functions below. To call one, reply with only a JSON object "
                '{"name": <function name>, "arguments": <its arguments as a JSON object>} and nothing else; '
                "otherwise reply in text.\nFunctions:\n")


@dataclass(frozen=True)
class Tools:
    """The functions a request offers (name -> {"description", "parameters"}) and how the reply may use them:
    AUTO, REQUIRED, or the one name that must be called."""

    functions: dict
    choice: str

    @classmethod
    def from_request(cls, tools: list | None, tool_choice) -> "Tools | None":
        """The request's tools and tool_choice, checked (a 400 naming the problem); None when no call is possible
        (no tools, or tool_choice "none")."""
        if tool_choice is not None and not tools:
            raise APIError(400, "tool_choice needs tools: add the functions to the request, or drop tool_choice",
                           param="tool_choice")
        if not tools or tool_choice == NONE:
            return None
        functions = {}
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise APIError(400, f'tools[{i}] is invalid: each tool is {{"type": "function", "function": '
                                    f'{{"name": ..., "parameters": {{...}}}}}}', param="tools")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
            if function["name"] in functions:
                raise APIError(400, f"tools[{i}]: a second function named {function['name']!r}", param="tools")
            functions[function["name"]] = {"description": function.get("description", ""), "parameters": parameters}
        return cls(functions, choice_of(tool_choice, functions))

    def call_schema(self) -> dict:
        """The JSON schema of a call this request allows: one object per function, name fixed, arguments its
        parameters."""
        names = [self.choice] if self.choice in self.functions else list(self.functions)
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": self.functions[name]["parameters"]},
                  "required": ["name", "arguments"]} for name in names]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    @property
    def text_allowed(self) -> bool:
        """Whether the reply may be text instead of a call (tool_choice "auto")."""
        return self.choice == AUTO

    def system_text(self) -> str:
        listed = [{"name": name, **spec} for name, spec in self.functions.items()]
        return INSTRUCTIONS + json.dumps(listed, ensure_ascii=False)

    def parse_call(self, text: str) -> dict | None:
        """OpenAI's tool_call for a reply that is a whole call, or None for text (or a call cut short)."""
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not (isinstance(call, dict) and call.get("name") in self.functions and isinstance(call.get("arguments"),
                                                                                             dict)):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def choice_of(tool_choice, functions: dict) -> str:
    """AUTO (the default), REQUIRED, or the name `{"type": "function", "function": {"name": N}}` asks for."""
    if tool_choice is None or tool_choice in (AUTO, REQUIRED):
        return tool_choice or AUTO
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise APIError(400, f'tool_choice {tool_choice!r} is invalid: use "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})",
                       param="tool_choice")
    return name


def turns_with_tools(turns: list[dict], tools: Tools | None) -> list[dict]:
    """The conversation as the chat template reads it: the tools described in the system turn (merged into the
    request's own system turn when it has one), the turns as they are."""
    if tools is None:
        return turns
    if turns and turns[0]["role"] == "system":
        return [{"role": "system", "content": turns[0]["content"] + "\n\n" + tools.system_text()}, *turns[1:]]
    return [{"role": "system", "content": tools.system_text()}, *turns]


__all__ = ["Tools", "turns_with_tools", "AUTO", "REQUIRED", "NONE"]
