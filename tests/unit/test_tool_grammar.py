"""Grammars of replies that may call tools (agent/tool_grammar.py), walked token by token with
llguidance over the default model's tokenizer: forced calls in every format, strict tools and
parallel_tool_calls false under tool_choice auto, a response format beside tools."""

from __future__ import annotations

import copy
import json

import pydantic
import pytest

from kvmesh.agent import grammars
from kvmesh.agent.conversation import Conversation, Message, Tool, ToolChoice
from kvmesh.agent.tool_grammar import reply_grammar
from kvmesh.agent.tool_parsers import get_parser, kimi_k2, parse_output
from kvmesh.errors import InvalidRequestError

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = Tool("get_weather", "", CITY)
STRICT = Tool("get_weather", "", CITY, strict=True)
TIME = Tool("get_time")
CANONICAL = {  # one call of get_weather(city="Paris") in each format
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "</tool_call>",
}
SECOND = '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


AUTO = ToolChoice()


def conversation(*tools: Tool, choice: ToolChoice = AUTO, parallel: bool = True):
    return Conversation((Message("user", "hi"),), tools, choice, parallel)


@pytest.fixture(scope="module")
def walk(tok):
    """walk(grammar, text, hf=None) -> (whole text accepted, may end there)."""
    import llguidance
    import llguidance.hf

    views = {}

    def run(grammar: str, text: str, hf=None) -> tuple[bool, bool]:
        hf = hf or tok.hf
        if id(hf) not in views:
            views[id(hf)] = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        matcher = llguidance.LLMatcher(views[id(hf)], grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = hf.encode(text, add_special_tokens=False)
        accepted = matcher.validate_tokens(ids) == len(ids)
        if accepted:
            matcher.consume_tokens(ids)
        return accepted, accepted and matcher.is_accepting()

    return run


@pytest.mark.parametrize("name", sorted(CANONICAL))
def test_forced_calls_in_every_format(name, tok, walk):
    named = conversation(WEATHER, TIME, choice=ToolChoice("named", "get_weather"))
    grammar = reply_grammar(named, name, tok.hf, None, "response_format")
    assert walk(grammar, CANONICAL[name]) == (True, True)
    (call,) = parse_output(get_parser(name, named.tools), CANONICAL[name]).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    wrong = CANONICAL[name].replace("city", "town")
    assert walk(grammar, wrong)[0] is False  # the schema's property, not another
    assert walk(grammar, "Sure, " + CANONICAL[name])[0] is False  # a call, not text


def test_required_allows_several_calls_unless_parallel_is_off(tok, walk):
    text = CANONICAL["hermes"] + SECOND
    required = ToolChoice("required")
    many = reply_grammar(conversation(WEATHER, TIME, choice=required), "hermes", tok.hf, None, "")
    one = reply_grammar(
        conversation(WEATHER, TIME, choice=required, parallel=False), "hermes", tok.hf, None, ""
    )
    assert walk(many, text) == (True, True)
    assert walk(one, text)[0] is False
    assert walk(one, CANONICAL["hermes"]) == (True, True)


def test_auto_with_a_strict_tool_frees_text_and_holds_calls_to_the_schema(tok, walk):
    grammar = reply_grammar(conversation(STRICT, TIME), "hermes", tok.hf, None, "")
    assert walk(grammar, "It is sunny <tool in Paris, I think.") == (True, True)
    assert walk(grammar, "Let me check.\n" + CANONICAL["hermes"] + SECOND) == (True, True)
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}'
    assert walk(grammar, "Let me check.\n" + bad)[0] is False
    unknown = '<tool_call>\n{"name": "get_news", "arguments": {}}'
    assert walk(grammar, unknown)[0] is False
    # the non-strict tool takes any object; text after the calls is not allowed
    anything = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    assert walk(grammar, anything) == (True, True)
    assert walk(grammar, CANONICAL["hermes"] + " done")[0] is False


def test_auto_grammar_only_where_something_must_hold(tok, walk):
    assert reply_grammar(conversation(WEATHER), "hermes", tok.hf, None, "") is None
    assert reply_grammar(conversation(), "hermes", tok.hf, "start: /a/", "") == "start: /a/"
    none = conversation(STRICT, choice=ToolChoice("none"))
    assert reply_grammar(none, "hermes", tok.hf, None, "") is None  # tools not offered
    single = reply_grammar(conversation(WEATHER, TIME, parallel=False), "hermes", tok.hf, None, "")
    assert walk(single, "Sure.\n" + CANONICAL["hermes"]) == (True, True)
    assert walk(single, "Sure.\n" + CANONICAL["hermes"] + SECOND)[0] is False


def test_bare_calls_under_auto(tok, walk):
    grammar = reply_grammar(conversation(STRICT), "llama3_json", tok.hf, None, "")
    assert walk(grammar, "Paris is sunny.") == (True, True)
    assert walk(grammar, CANONICAL["llama3_json"]) == (True, True)
    assert walk(grammar, '{"name": "get_weather", "parameters": {"town": "x"}}')[0] is False
    assert walk(grammar, '  {"free": "json"}')[0] is False  # a reply opening JSON is a call


def test_a_response_format_beside_tools(tok, walk):
    output = grammars.json_schema(
        {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]},
        "response_format",
    )
    grammar = reply_grammar(conversation(WEATHER), "hermes", tok.hf, output, "response_format")
    assert walk(grammar, '{"answer": 4}') == (True, True)
    assert walk(grammar, CANONICAL["hermes"]) == (True, True)  # or calls, never free text
    assert walk(grammar, "The answer is 4")[0] is False
    forced = conversation(WEATHER, choice=ToolChoice("required"))
    with pytest.raises(InvalidRequestError, match="'response_format' cannot both"):
        reply_grammar(forced, "hermes", tok.hf, output, "response_format")


def test_glm45_values_typed_by_the_schema(tok, walk):
    schema = {
        "type": "object",
        "required": ["code", "count"],
        "properties": {
            "code": {"type": "string"},
            "count": {"type": "integer"},
            "unit": {"type": "string", "enum": ["C", "F"]},
        },
    }
    tool = Tool("lookup", "", schema)
    text = (
        "<tool_call>lookup\n<arg_key>code</arg_key>\n<arg_value>042</arg_value>\n"
        "<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    (call,) = parse_output(get_parser("glm45", (tool,)), text).tool_calls
    assert json.loads(call.arguments) == {"code": "042", "count": 3}  # "042" stays text
    grammar = reply_grammar(
        conversation(tool, choice=ToolChoice("required")), "glm45", tok.hf, None, ""
    )
    assert walk(grammar, text) == (True, True)
    assert walk(grammar, text.replace("<arg_value>3<", '<arg_value>"3"<'))[0] is False
    unit = text.replace("</tool_call>", "<arg_key>unit</arg_key>\n<arg_value>K</arg_value>")
    assert walk(grammar, unit)[0] is False  # not one of the enum's values
    assert walk(grammar, text.replace("<arg_key>count", "<arg_key>cnt"))[0] is False


def test_delimiters_that_are_added_tokens_are_matched_by_id(tok, walk):
    """Kimi's delimiters as the special tokens they are in its tokenizer: the grammar names
    them by id, the call tokenized with them is accepted, and under auto the text before them
    needs no lazy rule (a special token is never text)."""
    hf = copy.deepcopy(tok.hf)
    specials = [kimi_k2.SECTION, kimi_k2.SECTION_END, kimi_k2.CALL, kimi_k2.ARGS, kimi_k2.CALL_END]
    hf.add_special_tokens({"additional_special_tokens": specials})
    named = conversation(WEATHER, choice=ToolChoice("named", "get_weather"))
    grammar = reply_grammar(named, "kimi_k2", hf, None, "")
    assert f"<[{hf.convert_tokens_to_ids(kimi_k2.CALL)}]>" in grammar
    assert kimi_k2.CALL not in grammar  # by id, never as text
    ids = hf.encode(CANONICAL["kimi_k2"], add_special_tokens=False)
    assert hf.convert_tokens_to_ids(kimi_k2.CALL) in ids
    assert walk(grammar, CANONICAL["kimi_k2"], hf) == (True, True)
    text = hf.decode(ids, skip_special_tokens=False)
    (call,) = parse_output(get_parser("kimi_k2"), text).tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    auto = reply_grammar(conversation(STRICT), "kimi_k2", hf, None, "")
    assert "lead:" in auto and "lead[lazy]" not in auto
    assert walk(auto, "Checking. " + CANONICAL["kimi_k2"], hf) == (True, True)


class _City(pydantic.BaseModel):
    name: str
    country: str


class _Trip(pydantic.BaseModel):  # nested models: `$defs` + `$ref`, as pydantic writes them
    origin: _City
    stops: list[_City]


class _Node(pydantic.BaseModel):  # recursive
    label: str
    children: list[_Node] = []


TRIP_CALLS = {  # plan_trip(origin=Paris, stops=[Lyon]) in each format
    "hermes": '<tool_call>\n{"name": "plan_trip", "arguments": ARGS}\n</tool_call>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.plan_trip:0"
    "<|tool_call_argument_begin|>ARGS<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>plan_trip\n"
    "```json\nARGS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "llama3_json": '{"name": "plan_trip", "parameters": ARGS}',
}
TRIP = {"origin": {"name": "Paris", "country": "FR"}, "stops": [{"name": "Lyon", "country": "FR"}]}


@pytest.mark.parametrize("name", sorted(TRIP_CALLS))
@pytest.mark.parametrize("mode", ["required", "named", "strict"])
def test_refs_resolve_against_each_tools_own_schema(name, mode, tok, walk):
    """Pydantic's `$defs` / `$ref` under every choice that enforces a schema, in every format
    (the call's schema holds the tool's: its refs must not resolve against the call's root)."""
    trip = Tool("plan_trip", "", _Trip.model_json_schema(), strict=mode == "strict")
    choice = {
        "required": ToolChoice("required"),
        "named": ToolChoice("named", "plan_trip"),
        "strict": AUTO,
    }[mode]
    grammar = reply_grammar(conversation(trip, TIME, choice=choice), name, tok.hf, None, "")
    call = TRIP_CALLS[name].replace("ARGS", json.dumps(TRIP))
    assert walk(grammar, call) == (True, True)
    wrong = TRIP_CALLS[name].replace("ARGS", json.dumps({**TRIP, "origin": {"name": "Paris"}}))
    assert walk(grammar, wrong)[0] is False  # the nested model's required field is held


def test_recursive_and_glm45_refs(tok, walk):
    tree = Tool("make_tree", "", _Node.model_json_schema())
    grammar = reply_grammar(
        conversation(tree, choice=ToolChoice("required")), "hermes", tok.hf, None, ""
    )
    args = {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}
    call = '<tool_call>\n{"name": "make_tree", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    assert walk(grammar, call) == (True, True)
    assert walk(grammar, call.replace('"c"', "3"))[0] is False
    trip = Tool("plan_trip", "", _Trip.model_json_schema())
    glm = reply_grammar(
        conversation(trip, choice=ToolChoice("required")), "glm45", tok.hf, None, ""
    )
    text = (
        "<tool_call>plan_trip\n<arg_key>origin</arg_key>\n<arg_value>"
        + json.dumps(TRIP["origin"])
        + "</arg_value>\n<arg_key>stops</arg_key>\n<arg_value>"
        + json.dumps(TRIP["stops"])
        + "</arg_value>\n</tool_call>"
    )
    assert walk(glm, text) == (True, True)


def test_draft06_definitions_and_one_of_as_a_response_format(tok, walk):
    schema = {
        "$schema": "http://json-schema.org/draft-06/schema#",
        "definitions": {
            "cat": {
                "type": "object",
                "properties": {"meow": {"type": "boolean"}},
                "required": ["meow"],
                "additionalProperties": False,
            },
            "dog": {
                "type": "object",
                "properties": {"bark": {"type": "integer"}},
                "required": ["bark"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "required": ["pet"],
        "additionalProperties": False,
        "properties": {
            "pet": {"oneOf": [{"$ref": "#/definitions/cat"}, {"$ref": "#/definitions/dog"}]}
        },
    }
    grammar = grammars.json_schema(schema, "response_format")
    assert walk(grammar, '{"pet": {"bark": 2}}') == (True, True)
    assert walk(grammar, '{"pet": {"purr": 2}}')[0] is False
