"""The grammar a reply that may call tools must follow, in the model's tool-call format.

- tool_choice required / named: the reply is calls (of any tool / of that one) whose arguments
  follow each tool's schema; one call when parallel_tool_calls is false or the choice is named.
- tool_choice auto: free text, then optionally calls after the format's trigger (a lazy rule:
  the text ends where the trigger first appears). Built only where something must hold: a
  `strict` tool (its arguments follow its schema; other tools' arguments are any object),
  parallel_tool_calls false (at most one call), or a `response_format` (the reply is either
  that format or calls).
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.agent import grammars
from kvmesh.agent.conversation import Conversation
from kvmesh.agent.tool_parsers import get_parser
from kvmesh.errors import InvalidRequestError

ANY_TEXT = r"(.|\n)*"
NOT_JSON = r"(\s*[^\s{](.|\n)*)?"  # text that does not open a JSON object (bare calls do)


def call_schema(conversation: Conversation) -> dict[str, Any] | None:
    """The JSON schema of one call ({"name", "arguments"}) this request may make, or None if
    it may make none. Forced calls follow every tool's schema; under auto only strict ones."""
    choice = conversation.tool_choice
    if not conversation.offers_tools:
        return None
    forced = choice.mode in ("required", "named")
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": grammars.rooted(t.parameters, t.name)
                if forced or t.strict
                else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in conversation.tools
        if choice.name in (None, t.name)
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def reply_grammar(
    conversation: Conversation,
    parser_name: str,
    hf_tokenizer: Any,
    output: str | None,
    output_field: str,
) -> str | None:
    """The whole reply's grammar (None: unconstrained); `output` is the response format's
    grammar, named `output_field` in errors."""
    schema = call_schema(conversation)
    if schema is None:
        return output
    parser = get_parser(parser_name, conversation.tools)
    literal = grammars.token_literals(hf_tokenizer)
    trigger = literal(parser.trigger)
    mode = conversation.tool_choice.mode
    if mode in ("required", "named"):
        if output is not None:
            raise InvalidRequestError(
                f"a forced tool call (tool_choice {mode}) and '{output_field}' cannot both "
                "constrain the reply"
            )
        many = mode == "required" and conversation.parallel_tool_calls
        start = "start: calls" if parser.bare_calls else f"start: {trigger} calls"
        return _checked(f"{start}\n{parser.call_grammar(schema, many, literal)}", conversation)
    strict = any(tool.strict for tool in conversation.tools)
    if output is None and not strict and conversation.parallel_tool_calls:
        return None
    rules = parser.call_grammar(schema, conversation.parallel_tool_calls, literal)
    bare = " | calls" if parser.bare_calls else ""
    if output is not None:
        main = f"start: @output | {trigger} calls{bare}\n{rules}"
        return _checked(_with_output(main, output), conversation, f"tools' with '{output_field}")
    lead = "lead[lazy]" if trigger.startswith('"') else "lead"  # a special token is never text
    text = NOT_JSON if parser.bare_calls else ANY_TEXT
    return _checked(
        f"start: TEXT | lead calls{bare}\n{lead}: TEXT {trigger}\nTEXT: /{text}/\n{rules}",
        conversation,
    )


def _with_output(main: str, output: str) -> str:
    """One llguidance grammar set: `main` (Lark) first, referring to the output as @output."""
    if output.lstrip().startswith("{"):  # already a grammar set (JSON schema, regex)
        others = json.loads(output)["grammars"]
    else:
        others = [{"lark_grammar": output}]
    others[0] = {**others[0], "name": "output"}
    return json.dumps({"grammars": [{"name": "reply", "lark_grammar": main}, *others]})


def _checked(grammar: str, conversation: Conversation, field: str = "tools") -> str:
    """The grammar, if llguidance can use it; else a 400 naming the tool whose schema it cannot
    enforce (checked one by one only then), or the field."""
    try:
        return grammars.checked(grammar, field)
    except InvalidRequestError:
        forced = conversation.tool_choice.mode in ("required", "named")
        for i, tool in enumerate(conversation.tools):
            if tool.strict or (forced and conversation.tool_choice.name in (None, tool.name)):
                grammars.json_schema(tool.parameters, f"tools[{i}]")  # raises naming it
        raise
