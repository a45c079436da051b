"""What a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` mean for its answer.

* ``tool_choice`` ``none``: the tools are rendered (the template decides how), no call is read out of
  the answer;
* ``auto`` (the default with tools): the model decides; calls it writes in its format are read out of
  the text by the tool-call parser (``router.tool_parsers``) into ``tool_calls``;
* ``required`` or a named function: the answer **is** one call (or several, when parallel calls are
  allowed and the choice is ``required``), enforced by a grammar of the parser's format whose JSON
  follows the tools' ``parameters`` schemas, so the call always parses and its arguments validate;
* ``auto`` with ``strict`` tools (OpenAI's structured function calling): free text, but once the model
  opens a call the grammar holds it to the schemas (formats whose marker is text: hermes);
* ``auto`` with a ``response_format``: the answer is either in that format or the calls, held to their
  schemas (``calls_instead_of_answer``): how an agent asks for tools and a typed final answer at once.
  vLLM's ``structured_outputs`` instead constrain the whole text, as vLLM applies them: a call is read out
  only when the constrained text is one.

The parser comes from ``router.tool_call_parser``: a format's name, or ``auto`` (inferred from the
chat template, which names its own markers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.errors import bad_request
from router.openai_schema import ChatCompletionRequest, NamedToolChoice
from router.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser, infer_tool_parser


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"name", "parameters"} of each offered tool
    parser: ToolParser | None = None  # reads calls out of the answer; None: nobody looks for calls
    forced: str | None = None  # "required", the named function, or None (the model decides)
    parallel: bool = True
    strict_auto: bool = False  # auto with strict tools: free text, but a call it starts must follow the schema

    @property
    def is_named(self) -> bool:
        return self.forced is not None and self.forced != "required"

    def calls_instead_of_answer(self, tokenizer) -> tuple[str, str] | None:
        """Under ``auto`` with a response format: the calls (rules, entry rule) the answer may be instead of the
        format (OpenAI's: the model calls tools, or answers in the format); None when it may not call."""
        if self.parser is None or self.forced is not None:
            return None
        return self.parser.call_grammar(self.tools, self.parallel, tokenizer), "tool_calls"

    def call_grammar(self, tokenizer) -> tuple[str, str] | None:
        """(Lark rules, their entry rule) the answer must follow; None when the tools constrain nothing."""
        if self.parser is None:
            return None
        if self.strict_auto:
            return self.parser.text_or_calls_grammar(self.tools, self.parallel, tokenizer), "tc_text_or_calls"
        if self.forced is None:
            return None
        tools = [t for t in self.tools if t["name"] == self.forced] if self.is_named else self.tools
        return self.parser.call_grammar(tools, self.parallel and not self.is_named, tokenizer), "tool_calls"


def plan_tools(body: ChatCompletionRequest, parser_setting: str, chat_template: str | None) -> ToolPlan:
    """The request's tool plan, or a 400 that says what is wrong with its tool fields."""
    tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in body.tools or ()]
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: a required or named tool call needs tools", param="tool_choice")
        return ToolPlan()
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same name", param="tools")
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(tools=tools, parallel=body.parallel_tool_calls)
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else (None if choice == "auto" else "required")
    if forced not in (None, "required") and forced not in names:
        raise bad_request(f"tool_choice: no tool named {forced!r} (tools: {', '.join(names)})", param="tool_choice")
    strict = [t.function.name for t in body.tools if t.function.strict]
    parser_name = infer_tool_parser(chat_template) if parser_setting == "auto" else parser_setting
    if parser_name in (None, "none"):
        how = ("its chat template names no tool-call format Tandem knows" if parser_setting == "auto"
               else "the router runs with tool_call_parser none")
        raise bad_request(f"tools: this server cannot read tool calls for this model ({how}); start the router "
                          f"with --router-tool-call-parser {'|'.join(sorted(TOOL_PARSERS))}, or send tool_choice none",
                          param="tools")
    parser = get_tool_parser(parser_name)
    strict_auto = bool(strict) and forced is None
    if strict_auto and parser.text_or_calls_grammar(tools, body.parallel_tool_calls, None) is None:
        raise bad_request(f"tools: strict ({', '.join(strict)}) under tool_choice auto is enforced for the hermes "
                          f"format only (this model's is {parser.name}); send tool_choice required or the function's "
                          "name, or drop strict", param="tools")
    return ToolPlan(tools=tools, parser=parser, forced=forced, parallel=body.parallel_tool_calls,
                    strict_auto=strict_auto)
