"""A JSON schema as an automaton's syntax tree: the strings the model may write are JSON texts that validate.

    node = schema_node({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    dfa = compile_dfa(node)          # minillm.decoding.automaton: the same DFA a regex gives
    dfa = schema_dfa(schema)         # the same, and past the automaton's limits an error naming the keyword

The supported subset (what OpenAI's strict mode and most application schemas use): `type` (string,
number, integer, boolean, null, object, array, or a list of them), `properties` / `required` /
`additionalProperties`, `items` / `minItems` / `maxItems`, `minLength` / `maxLength`, `pattern`,
`enum`, `const`, `anyOf`, `$ref` into `$defs` / `definitions` (not recursive), and annotations
(`title`, `description`, ...), which constrain nothing. Any other keyword is refused by name
(`UnsupportedSchema`): a constraint silently dropped would let invalid output through.

What the generated text looks like (every choice keeps it valid, none loses a value):
- properties come in the schema's order; optional ones may be left out; no undeclared ones
  (a schema that allows extra properties is still satisfied without them);
- whitespace is at most one space between tokens (`WHITESPACE`), so a model cannot fill its
  budget with newlines;
- strings hold any character but `"`, `\\` and control characters, plus JSON's escapes;
- numbers have at most 16 digits before the point and 16 after, and an exponent of at most 2.

Nesting. A schema nests as deep as it is written, so its language is regular and a finite
automaton is exact. "Any JSON value" (`{"type": "json_object"}`, an object without `properties`,
an array without `items`) nests without end, which needs a stack (a pushdown automaton, as
xgrammar keeps). Here it is unrolled `ANY_DEPTH` levels deep: the stack becomes part of the
finite state, every output is still valid JSON of the schema, and deeper nesting is what the
model cannot write.
"""

from __future__ import annotations

import json

from .automaton import DFA, Alt, Chars, Node, Repeat, Separated, Seq, compile_dfa, literal, negated
from .limits import Budget, PatternError, TooLarge
from .regex import parse_regex

ANY_DEPTH = 4  # how deep free-form JSON (json_object mode) may nest: objects and arrays within objects ...
WHITESPACE = Repeat(literal(" "), 0, 1)
ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "strict"}
SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength",
             "maxLength", "pattern", "enum", "const", "anyOf", "$ref"} | ANNOTATIONS
TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")


class UnsupportedSchema(PatternError):
    """A schema (keyword) outside the supported subset; `keyword` names it for an API error."""

    def __init__(self, keyword: str, where: str, why: str = "is not supported", list_supported: bool = True):
        place = f" (at {where})" if where else ""
        supported = f"; supported: {', '.join(sorted(SUPPORTED))}" if list_supported else ""
        super().__init__(f"JSON schema keyword {keyword!r}{place} {why}{supported}")
        self.keyword = keyword


# ------------------------------------------------------------------ JSON's own pieces


def json_string(least: int = 0, most: int | None = None, content: Node | None = None) -> Node:
    """A JSON string: characters (or escapes) between quotes; least..most characters."""
    if content is None:
        plain = Chars(negated([(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))]))
        hex_digit = Chars(((ord("0"), ord("9")), (ord("A"), ord("F")), (ord("a"), ord("f"))))
        escape = Seq((literal("\\"), Alt((Chars(tuple((ord(c), ord(c)) for c in '"\\/bfnrt')),
                                          Seq((literal("u"), Repeat(hex_digit, 4, 4)))))))
        content = Repeat(Alt((plain, escape)), least, most)
    return Seq((literal('"'), content, literal('"')))


DIGITS = Chars(((ord("0"), ord("9")),))
NONZERO = Chars(((ord("1"), ord("9")),))
# At most 16 digits before the point and 16 after (llama.cpp's JSON grammars bound them alike): a double holds
# no more, and a model that repeats a digit cannot run on forever.
INTEGER = Seq((Repeat(literal("-"), 0, 1), Alt((literal("0"), Seq((NONZERO, Repeat(DIGITS, 0, 15)))))))
NUMBER = Seq((INTEGER, Repeat(Seq((literal("."), Repeat(DIGITS, 1, 16))), 0, 1),
              Repeat(Seq((Chars(((ord("E"), ord("E")), (ord("e"), ord("e")))),
                          Repeat(Chars(((ord("+"), ord("+")), (ord("-"), ord("-")))), 0, 1), Repeat(DIGITS, 1, 2))),
                     0, 1)))
BOOLEAN = Alt((literal("true"), literal("false")))
NULL = literal("null")


def padded(text: str) -> Node:
    """A JSON punctuation mark with optional whitespace on both sides."""
    return Seq((WHITESPACE, literal(text), WHITESPACE))


def json_object(members: Node) -> Node:
    return Seq((literal("{"), WHITESPACE, members, WHITESPACE, literal("}")))


def json_array(item: Node, least: int = 0, most: int | None = None) -> Node:
    return Seq((literal("["), WHITESPACE, Separated(item, padded(","), least, most), WHITESPACE, literal("]")))


def any_value(depth: int = ANY_DEPTH) -> Node:
    """Any JSON value, objects and arrays nested at most `depth` levels."""
    scalars = [json_string(), NUMBER, BOOLEAN, NULL]
    if depth <= 0:
        return Alt(tuple(scalars))
    return Alt((*scalars, any_object(depth), json_array(any_value(depth - 1))))


def any_object(depth: int = ANY_DEPTH, values: Node | None = None) -> Node:
    """An object with any keys; its values any JSON nested depth - 1 deeper (or `values`)."""
    member = Seq((json_string(), padded(":"), values if values is not None else any_value(depth - 1)))
    return json_object(Separated(member, padded(",")))


class Properties(Node):
    """Declared properties in order, required ones always, optional ones maybe, commas only between.

    Two lanes through the members: "nothing written yet" and "something written". Each
    member is entered from the first lane directly and from the second after a comma, and
    leaves into the second; an optional member can be stepped over in either lane. One copy
    of each member's value serves both lanes.
    """

    def __init__(self, members: list[tuple[str, Node, bool]]):
        self.members = members  # (name, value, required)

    def build(self, nfa):
        empty_lane, written_lane = nfa.new_state(), nfa.new_state()
        start = empty_lane
        for name, value, required in self.members:
            entry, exit_ = Seq((literal(json.dumps(name, ensure_ascii=False)), padded(":"), value)).build(nfa)
            comma_entry, comma_exit = padded(",").build(nfa)
            next_empty, next_written = nfa.new_state(), nfa.new_state()
            nfa.empty[empty_lane].append(entry)
            nfa.empty[written_lane].append(comma_entry)
            nfa.empty[comma_exit].append(entry)
            nfa.empty[exit_].append(next_written)
            if not required:
                nfa.empty[empty_lane].append(next_empty)
                nfa.empty[written_lane].append(next_written)
            empty_lane, written_lane = next_empty, next_written
        end = nfa.new_state()
        nfa.empty[empty_lane].append(end)
        nfa.empty[written_lane].append(end)
        return start, end


# ------------------------------------------------------------------ schema -> syntax tree


def schema_node(schema: dict | bool, any_depth: int = ANY_DEPTH) -> Node:
    """The syntax tree of the JSON texts that validate against `schema` (the supported subset)."""
    return SchemaCompiler(schema, any_depth).node(schema, "", ())


# Text that cannot be the start of a JSON value's object: its first character is not "{" nor whitespace. The other
# branch of "JSON matching a schema, or text" (a tool call or a reply, `minillm.serving.tools`).
TEXT_NOT_AN_OBJECT = Seq((Chars(negated([(ord("{"), ord("{")), (ord(" "), ord(" ")), (0x09, 0x0D)])),
                          Repeat(Chars(negated(())))))


def schema_dfa(schema: dict | bool, budget: Budget | None = None, or_text: bool = False) -> DFA:
    """The schema's automaton, within `budget`; with `or_text`, text that does not begin with "{" is accepted
    too (so the schema's branch is taken exactly when the output begins with "{"). Past a limit the error names
    the keyword that asked for the most copies (minLength 5000 copies a character 5,000 times), since that is
    what a user can change."""
    compiler = SchemaCompiler(schema, ANY_DEPTH)
    node = compiler.node(schema, "", ())
    if or_text:
        node = Alt((node, TEXT_NOT_AN_OBJECT))
    try:
        return compile_dfa(node, budget)
    except TooLarge as e:
        if not compiler.counted:
            raise
        count, keyword, where = max(compiler.counted)
        raise UnsupportedSchema(keyword, where, f"= {count} is too large to compile: {e}",
                                list_supported=False) from None


class SchemaCompiler:
    def __init__(self, root, any_depth: int):
        self.root, self.any_depth = root, any_depth
        self.counted: list[tuple[int, str, str]] = []  # (count, keyword, where) of every count written

    def counts(self, schema: dict, low: str, high: str, where: str) -> tuple[int, int | None]:
        least, most = counts(schema, low, high, where)
        self.counted += [(least, low, where)] + ([(most, high, where)] if most is not None else [])
        return least, most

    def node(self, schema, where: str, refs: tuple[str, ...]) -> Node:
        if schema is True or schema == {}:
            return any_value(self.any_depth)
        if not isinstance(schema, dict):
            raise UnsupportedSchema(str(schema), where, "is not a schema (a JSON object, or true)")
        for keyword, value in schema.items():
            if keyword not in SUPPORTED:
                raise UnsupportedSchema(keyword, where)
        if "$ref" in schema:
            return self.reference(schema["$ref"], where, refs)
        if "const" in schema:
            return json_literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise UnsupportedSchema("enum", where, "must be a non-empty list")
            return Alt(tuple(json_literal(value) for value in schema["enum"]))
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                raise UnsupportedSchema("anyOf", where, "must be a non-empty list of schemas")
            return Alt(tuple(self.node(s, f"{where}.anyOf[{i}]", refs) for i, s in enumerate(options)))
        kind = schema.get("type")
        if kind is None:  # the type follows from the keywords, else anything
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
            if kind is None:
                return any_value(self.any_depth)
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or any(k not in TYPES for k in kinds):
            raise UnsupportedSchema("type", where, f"must be one of {', '.join(TYPES)} (or a list of them), "
                                                   f"not {kind!r}")
        options = tuple(self.typed(k, schema, where, refs) for k in kinds)
        return options[0] if len(options) == 1 else Alt(options)

    def typed(self, kind: str, schema: dict, where: str, refs) -> Node:
        if kind == "string":
            least, most = self.counts(schema, "minLength", "maxLength", where)
            content = None
            if "pattern" in schema:
                if least or most is not None:
                    raise UnsupportedSchema("pattern", where, "together with minLength/maxLength is not supported")
                content = string_pattern(schema["pattern"], where)
            return json_string(least, most, content)
        if kind == "number":
            return NUMBER
        if kind == "integer":
            return INTEGER
        if kind == "boolean":
            return BOOLEAN
        if kind == "null":
            return NULL
        if kind == "array":
            least, most = self.counts(schema, "minItems", "maxItems", where)
            items = schema.get("items", True)
            return json_array(self.node(items, f"{where}.items", refs), least, most)
        properties = schema.get("properties")
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if properties is None:
            if extra is False:
                return literal("{}") if not required else self.unsatisfiable("required", where)
            values = None if extra is True else self.node(extra, f"{where}.additionalProperties", refs)
            return any_object(self.any_depth, values) if not required else self.unsatisfiable("required", where)
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise UnsupportedSchema("properties", where, "must be an object (and required a list of names)")
        missing = [name for name in required if name not in properties]
        if missing:
            raise UnsupportedSchema("required", where, f"names {missing} that properties does not declare")
        members = [(name, self.node(sub, f"{where}.properties.{name}", refs), name in required)
                   for name, sub in properties.items()]
        return json_object(Properties(members))

    def unsatisfiable(self, keyword: str, where: str):
        raise UnsupportedSchema(keyword, where, "without properties is not supported")

    def reference(self, ref, where: str, refs: tuple[str, ...]) -> Node:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchema("$ref", where, f"{ref!r}: only references inside the schema (#/...) are supported")
        if ref in refs:
            raise UnsupportedSchema("$ref", where, f"{ref!r} is recursive: recursive schemas are not supported")
        target = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise UnsupportedSchema("$ref", where, f"{ref!r} points nowhere in the schema")
            target = target[part]
        return self.node(target, ref, (*refs, ref))


def counts(schema: dict, low: str, high: str, where: str) -> tuple[int, int | None]:
    least, most = schema.get(low, 0), schema.get(high)
    for name, value in ((low, least), (high, most)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise UnsupportedSchema(name, where, f"must be an integer >= 0, not {value!r}")
    if most is not None and most < least:
        raise UnsupportedSchema(high, where, f"{most} is below {low} {least}: nothing could validate")
    return least, most


def json_literal(value) -> Node:
    """One JSON value written exactly (enum, const)."""
    return literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def string_pattern(pattern, where: str) -> Node:
    """A string's content matching `pattern` (JSON Schema's `pattern` searches: unanchored ends take anything).

    Characters that would need escaping in JSON (quote, backslash, controls) are left out of the
    pattern's classes: fewer strings, all of them valid.
    """
    if not isinstance(pattern, str):
        raise UnsupportedSchema("pattern", where, "must be a string")
    anchored_start, anchored_end = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    try:
        node = parse_regex(pattern)
    except PatternError as e:
        raise UnsupportedSchema("pattern", where, f"cannot be used: {e}") from None
    anything = Repeat(Chars(SAFE))
    node = without_escapes(node)
    return Seq(((Seq(()) if anchored_start else anything), node, (Seq(()) if anchored_end else anything)))


SAFE = negated([(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))])


def without_escapes(node: Node) -> Node:
    """The same tree with every character class cut to characters a JSON string holds unescaped."""
    if isinstance(node, Chars):
        allowed = set(SAFE)
        kept = tuple((max(lo, a), min(hi, b)) for lo, hi in node.ranges for a, b in allowed
                     if max(lo, a) <= min(hi, b))
        return Chars(kept)
    if isinstance(node, (Seq, Alt)):
        return type(node)(tuple(without_escapes(item) for item in node.items))
    if isinstance(node, Repeat):
        return Repeat(without_escapes(node.item), node.least, node.most)
    return node


JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's response_format {"type": "json_object"}: any object


__all__ = ["ANY_DEPTH", "JSON_OBJECT_SCHEMA", "UnsupportedSchema", "any_object", "any_value", "schema_dfa",
           "schema_node"]
