"""Lesson 18: structured output. The automaton, the token mask and constrained decoding, against brute force.

References that share no code with the package:
- Python's `re.fullmatch` (re.ASCII) decides which strings a regex accepts, and the `regex`
  module's partial matching (`fullmatch(..., partial=True)`) which strings are a prefix of an
  accepted one: the "viable prefix" oracle a token mask must agree with;
- `json.loads` and `jsonschema` decide which outputs are JSON matching their schema;
- a brute-force decoder takes the full forward's logits at every step and picks the best token
  whose text keeps the oracle's viable prefix.
"""

from __future__ import annotations

import json
import random
import re

import httpx
import jsonschema
import pytest
import regex
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.decoding.automaton import PatternError, compile_dfa, utf8_sequences
from minillm.decoding.json_schema import UnsupportedSchema, schema_node
from minillm.decoding.regex import parse_regex, regex_dfa
from minillm.decoding.sampling import SamplingConfig, SamplingError
from minillm.decoding.structured import Constraint, TokenIndex, Vocabulary, token_index
from minillm.model.tiny import tiny_pair
from minillm.runtime.continuous import generate_continuous
from minillm.serving.launch import BackgroundServer
from minillm.strategies.generate import generate

# ------------------------------------------------------------------ a small byte-level vocabulary for the tiny models

EOS = 0
PIECES = ["<eos>", "{", "}", "[", "]", '"', ":", ",", " ", '{"', '":', '",', '"}', ', "', ": ", '": "', "true",
          "false", "null", "tru", "e", "nu", "ll", *"0123456789", "-", ".", "12", "a", "b", "c", "x", "y", "z",
          "name", "age", "id", "tags", "ok", "yes", "no", "!", "é", b"\xc3", b"\xa9", "日", b"\xe6\x97", b"\xa5",
          "\\", "\\n", "n", "u", "E", "+", "\n", "  ", "ab", "na", "me", '"a', "x}", "]}", "}}", "[]", "{}", '""',
          "Al", "ice", " Bob", "o", "t", "s", "i", "d", "g", "  \n", "_", "@", "A", "Z", "'", "/", "1.", "-1", "r", "l",
          "m", "k"]
assert len(PIECES) == 96, len(PIECES)


class ByteTokenizer:
    """Byte strings as tokens; token 0 is EOS (special: it stands for no text). decode joins the bytes, as
    byte-level BPE does.

    SMALL: 96 pieces: JSON punctuation, words, digits, a two-byte and a three-byte character split in
    halves (brute force over it is cheap). FULL adds every single byte SMALL lacks, as byte-level BPE
    has them: any schema can be spelled.
    """

    eos_token_id = EOS
    special_token_ids = (EOS,)
    chat_template = None

    def __init__(self, pieces):
        self.pieces = [p if isinstance(p, bytes) else p.encode() for p in pieces]
        self.vocab_size = len(self.pieces)

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == EOS else self.pieces[token_id]

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def encode(self, text: str) -> list[int]:  # greedy longest match; enough for prompts in tests
        data, ids = text.encode(), []
        while data:
            best = max((i for i in range(1, self.vocab_size) if data.startswith(self.pieces[i])),
                       key=lambda i: len(self.pieces[i]))
            ids.append(best)
            data = data[len(self.pieces[best]):]
        return ids


SMALL = ByteTokenizer(PIECES)
FULL = ByteTokenizer([*PIECES, *(bytes([b]) for b in range(256) if bytes([b]) not in SMALL.pieces)])
FULL.chat_template = "role: content"  # the server asks for one; apply_chat_template above is what runs


def tiny_model(kind: str = "llama", seed: int = 0, tokenizer=SMALL):
    return tiny_pair(kind, seed=seed, context_length=256, vocab_size=tokenizer.vocab_size)[1]


# ------------------------------------------------------------------ the oracle: prefixes of accepted strings


def viable(pattern: str, data: bytes) -> bool:
    """Whether `data` is a prefix of the UTF-8 of some string `pattern` fully matches (brute force).

    Whole characters go to `regex`'s partial matching; a trailing incomplete character is completed
    with every character its bytes could begin (two- and three-byte leads only).
    """
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            head = data[:cut].decode()
        except UnicodeDecodeError:
            continue
        tail = data[cut:]
        if not tail:
            return regex.fullmatch(pattern, head, flags=regex.ASCII, partial=True) is not None
        lead = tail[0]
        if lead >> 5 == 0b110:
            candidates = range(0x80, 0x800)
        elif lead >> 4 == 0b1110:
            candidates = (cp for cp in range(0x800, 0x10000) if not 0xD800 <= cp <= 0xDFFF)
        else:
            return False
        completions = [chr(cp) for cp in candidates if chr(cp).encode().startswith(tail)]
        return any(regex.fullmatch(pattern, head + c, flags=regex.ASCII, partial=True) for c in completions)
    return False


PATTERNS = [
    r"(yes|no)!{1,3}",
    r"[a-c]+\d{0,2}",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r'"[^"\\]*"',
    r"(true|false|null)",
    r"\w+@\w+\.(com|org)",
    r"[é日]+x?",
    r"(ab|a)*b",
    r"x{2,}y?|[0-9]{3}",
    r"[^a-z\n]{1,4}",
]


# ------------------------------------------------------------------ UTF-8 and the regex automaton


@given(st.integers(0, 0x10FFFF), st.integers(0, 0x10FFFF), st.integers(0, 0x10FFFF))
def test_utf8_sequences_match_exactly_the_code_points_of_the_range(a, b, cp):
    lo, hi = min(a, b), max(a, b)
    if 0xD800 <= cp <= 0xDFFF:
        return
    data = chr(cp).encode()
    matches = [s for s in utf8_sequences(lo, hi)
               if len(s) == len(data) and all(x <= byte <= y for byte, (x, y) in zip(data, s))]
    assert len(matches) == (1 if lo <= cp <= hi else 0)


@pytest.mark.parametrize("pattern", PATTERNS)
@given(data=st.data())
def test_the_dfa_accepts_what_re_fullmatch_accepts(pattern, data):
    dfa = regex_dfa(pattern)
    matching = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    assert dfa.accepts(matching.encode()), matching
    other = data.draw(st.text(alphabet="abcxyz0129.-!\"\\é日 yesno@", max_size=8))
    assert dfa.accepts(other.encode()) == bool(re.fullmatch(pattern, other, re.ASCII)), other
    # every prefix of a matching string is a state; the walk agrees with the partial-match oracle
    cut = data.draw(st.integers(0, len(matching.encode())))
    state = dfa.walk(dfa.start, matching.encode()[:cut])
    assert state >= 0
    mutated = other.encode()[:cut]
    assert (dfa.walk(dfa.start, mutated) >= 0) == viable(pattern, mutated), mutated


@pytest.mark.parametrize("pattern", [r"a(?=b)", r"(a)\1", r"\bword", r"a{3,2}", r"(ab", r"a++"])
def test_what_is_not_supported_is_refused_by_name(pattern):
    with pytest.raises(PatternError, match="regex"):
        parse_regex(pattern)


# ------------------------------------------------------------------ the token mask against brute force


def random_states(dfa, n: int, seed: int) -> list[bytes]:
    """Byte prefixes that reach a state by random walks (half characters included, but no four-byte ones: the
    oracle completes at most 4096 characters), and the empty one."""
    rng = random.Random(seed)
    prefixes = [b""]
    for _ in range(n):
        data, state = b"", dfa.start
        for _ in range(rng.randint(0, 12)):  # a random walk through the automaton's live moves
            moves = [b for b in range(0xF0) if dfa.transitions[state, b] >= 0]
            if not moves:
                break
            byte = rng.choice(moves)
            data, state = data + bytes([byte]), int(dfa.transitions[state, byte])
        prefixes.append(data)
    return prefixes


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_mask_equals_brute_force_on_random_states(pattern):
    dfa = regex_dfa(pattern)
    index = TokenIndex(dfa, Vocabulary.of(SMALL, len(PIECES)))
    for prefix in random_states(dfa, 12, seed=len(pattern)):
        state = dfa.walk(dfa.start, prefix)
        assert state >= 0 and viable(pattern, prefix), prefix
        mask = torch.from_numpy(index.byte_next_states(state) >= 0)  # bytes alone: whether tokens can finish
        # the text is test_the_mask_follows_tokens_that_can_finish_the_text's question
        mask[EOS] = bool(dfa.accepting[state])
        for token in range(1, len(PIECES)):
            expected = viable(pattern, prefix + SMALL.token_bytes(token))
            assert bool(mask[token]) == expected, (pattern, prefix, SMALL.token_bytes(token))
        whole = prefix.decode(errors="ignore").encode() == prefix and re.fullmatch(pattern, prefix.decode(), re.ASCII)
        assert bool(mask[EOS]) == bool(whole) == bool(dfa.accepting[state])


def finishable(pattern: str, prefix: bytes, vocabulary: list[bytes], depth: int) -> bool:
    """Brute force: some sequence of at most `depth` tokens turns `prefix` into a full match."""
    frontier = {prefix}
    for _ in range(depth + 1):
        if any(text.decode(errors="replace").encode() == text and re.fullmatch(pattern, text.decode(), re.ASCII)
               for text in frontier):
            return True
        frontier = {text + token for text in frontier for token in vocabulary if viable(pattern, text + token)}
    return False


@pytest.mark.parametrize("pattern,vocabulary", [
    ("(ab|cd)e?", [b"a", b"cd", b"e", b"de"]),  # "a" can never be finished: no "b"
    ("[é日]x", [b"\xc3", b"\xa9x", "日".encode(), b"\xe6\x97", b"x"]),  # 日's lead byte alone leads nowhere
    ("a{2,3}|b", [b"aa", b"aaa", b"b"]),
    ('"[a-z]{1,3}"', [b'"', b'"a', b"bc", b'c"', b"ab"]),
])
def test_the_mask_follows_tokens_that_can_finish_the_text(pattern, vocabulary):
    """A vocabulary missing some bytes: a token is allowed only where tokens can still finish the text."""
    index = TokenIndex(regex_dfa(pattern), Vocabulary([None, *vocabulary], (0,)))
    assert index.live is not None  # the vocabulary lacks bytes the automaton needs
    for prefix in [b"", *(v for v in vocabulary), *(a + b for a in vocabulary for b in vocabulary)]:
        state = index.dfa.walk(index.dfa.start, prefix)
        if state < 0 or not finishable(pattern, prefix, vocabulary, 4):
            continue
        allowed = index.next_states(state) >= 0
        for token, data in enumerate(vocabulary, start=1):
            assert allowed[token] == finishable(pattern, prefix + data, vocabulary, 4), (prefix, data)


def test_the_real_vocabulary_mask_equals_walking_each_token():
    """On a big vocabulary (GPT-2's 50257 tokens, special ones excluded) the vectorised walk equals the walk of
    each token's bytes, one at a time."""
    from minillm.model.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    index = token_index("json_schema", json.dumps(schema), tok, tok.vocab_size)
    dfa = index.dfa
    for prefix in [b"", b'{"', b'{"name": "caf\xc3', b'{"name":"x", "n":', b'{"n": -1']:
        state = dfa.walk(dfa.start, prefix)
        assert state >= 0, prefix
        fast = index.next_states(state)
        slow = [dfa.walk(state, tok.token_bytes(t)) if t != tok.eos_token_id else -1 for t in range(tok.vocab_size)]
        assert fast.tolist() == slow, prefix
    assert not bool(index.mask(dfa.start)[tok.eos_token_id])


# ------------------------------------------------------------------ JSON schemas: the language


DEV_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"enum": ["x", 2, None]},
                                      "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     "required": ["b"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": ["string", "null"]}},
                                                "required": ["x"]}}, "required": ["inner"]},
    {"type": "object"},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
]


def json_instances(schema, rng: random.Random, depth: int = 0):
    """Random instances of a schema of the supported subset (a brute-force generator, for completeness)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    kind = rng.choice(kind) if isinstance(kind, list) else kind
    if kind == "string":
        return "".join(rng.choice("ab é\"\\\n日") for _ in range(rng.randint(0, schema.get("maxLength", 4))))
    if kind == "integer":
        return rng.randint(-1000, 1000)
    if kind == "number":
        return rng.choice([0.5, -2.25, 3, 1e5, 12.0])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [json_instances(schema.get("items", {"type": "integer"}), rng, depth + 1) for _ in range(n)]
    if "properties" not in schema:
        return {"k": [1, {"z": None}], "s": "v"} if depth == 0 else {}
    return {name: json_instances(sub, rng, depth + 1) for name, sub in schema["properties"].items()
            if name in schema.get("required", []) or rng.random() < 0.5}


@pytest.mark.parametrize("schema", DEV_SCHEMAS, ids=range(len(DEV_SCHEMAS)))
def test_schema_automaton_accepts_valid_instances_and_only_json_that_validates(schema):
    dfa = compile_dfa(schema_node(schema))
    rng = random.Random(0)
    for _ in range(40):  # completeness: instances in the canonical layouts are accepted
        instance = json_instances(schema, rng)
        jsonschema.validate(instance, schema)
        for separators in ((",", ":"), (", ", ": ")):
            assert dfa.accepts(json.dumps(instance, separators=separators, ensure_ascii=False).encode()), instance
    for _ in range(200):  # soundness: random accepted walks are JSON that validates
        data, state = b"", dfa.start
        while len(data) < 400:
            if dfa.accepting[state] and (rng.random() < 0.3 or dfa.is_complete(state)):
                break
            moves = [b for b in range(256) if dfa.transitions[state, b] >= 0]
            byte = rng.choice([b for b in moves if b < 0x80] or moves) if rng.random() < 0.9 else rng.choice(moves)
            data, state = data + bytes([byte]), int(dfa.transitions[state, byte])
        if dfa.accepting[state]:
            jsonschema.validate(json.loads(data.decode()), schema)
    for bad in ['{"name":"x"}', '{"age":1,"name":"x"}', "[]", '{"a":1,}', "null", '{"b":"x"', '{"b":"y"}']:
        if dfa.accepts(bad.encode()):
            jsonschema.validate(json.loads(bad), schema)


def test_json_schema_mask_equals_brute_force_against_a_hand_written_regex():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a"]}
    # The same language by hand: one optional space around punctuation, b may be left out.
    pattern = r'\{ ?"a" ?: ?-?(0|[1-9][0-9]*)( ?, ?"b" ?: ?("x"|"y"))? ?\}'
    index = token_index("json_schema", json.dumps(schema), SMALL, len(PIECES))
    dfa = index.dfa
    for prefix in random_states(dfa, 30, seed=1):
        state = dfa.walk(dfa.start, prefix)
        assert viable(pattern, prefix)
        for token in range(1, len(PIECES)):
            assert bool(index.mask(state)[token]) == viable(pattern, prefix + SMALL.token_bytes(token)), \
                (prefix, SMALL.token_bytes(token))


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "string", "format": "date-time"}, "format"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "minimum"),
    ({"oneOf": [{"type": "string"}]}, "oneOf"),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, "$ref"),
    ({"type": "tuple"}, "type"),
])
def test_an_unsupported_schema_names_the_keyword(schema, keyword):
    with pytest.raises(UnsupportedSchema) as error:
        schema_node(schema)
    assert error.value.keyword == keyword and repr(keyword) in str(error.value)


def test_json_object_has_the_states_the_lesson_quotes():
    """Lesson 18's README quotes the size of `json_object`'s automaton (any JSON object, its nesting unrolled
    ANY_DEPTH levels deep): a change to the unrolling must change the README too."""
    from minillm.decoding.structured import constraint_dfa

    assert constraint_dfa("json_schema", '{"type": "object"}').num_states == 1396


# ------------------------------------------------------------------ bounded work: limits and cancellation


@pytest.mark.parametrize("kind,source,limit", [
    ("regex", "x{300000}", "'nfa_states'"),                 # a count copies its item once per count
    ("regex", "(a|b)*a(a|b){16}", "'dfa_states'"),           # 2^17 subsets of an NFA of a few dozen states
])
def test_a_pattern_past_the_automatons_limits_is_refused(kind, source, limit):
    from minillm.decoding.limits import Budget, TooLarge

    with pytest.raises(TooLarge) as error:
        compile_dfa(parse_regex(source), Budget(max_nfa_states=50_000, max_dfa_states=5_000, seconds=float("inf")))
    assert repr(error.value.limit) == limit and "use smaller counts" in str(error.value)


def test_an_explosive_schema_is_refused_naming_the_keyword_that_asked_for_it():
    """The issue's schema: minLength 5000 once built for minutes; now a limit stops it and the error names the
    count a user can change, and where it is."""
    from minillm.decoding.json_schema import schema_dfa

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10},
                                                "b": {"type": "array", "items": {"type": "string", "minLength": 5000}}}}
    with pytest.raises(UnsupportedSchema) as error:
        schema_dfa(schema)
    assert error.value.keyword == "minLength" and "(at .properties.b.items)" in str(error.value)
    assert "= 5000 is too large" in str(error.value) and "supported:" not in str(error.value)
    assert schema_dfa({"type": "string", "minLength": 50}).accepts(b'"' + b"x" * 50 + b'"')  # small counts compile


def test_a_compile_stops_when_it_is_cancelled_and_when_its_seconds_run_out():
    """Both checks run between states: a set `cancelled` (the server's request went away) stops the compile with
    `Cancelled`, not an error for the user; a budget of no seconds stops it with `TooLarge`."""
    import threading

    from minillm.decoding.limits import Budget, Cancelled, TooLarge

    node = parse_regex("[a-z]{5000}")
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(Cancelled):
        compile_dfa(node, Budget(cancelled=cancelled))
    with pytest.raises(TooLarge) as error:
        compile_dfa(node, Budget(seconds=0.0))
    assert error.value.limit == "seconds" and not isinstance(Cancelled("x"), ValueError)  # never a 400


def test_settings_check_the_constraint():
    assert SamplingConfig(json_schema={"type": "object"}).constraint == ("json_schema", '{"type": "object"}')
    assert SamplingConfig(regex="a+").constraint == ("regex", "a+")
    for bad in (dict(json_schema="{not json"), dict(regex=""), dict(json_schema={}, regex="a")):
        with pytest.raises(SamplingError):
            SamplingConfig(**bad)


# ------------------------------------------------------------------ decoding: greedy equals brute force


def brute_force_greedy(model, prompt: list[int], pattern: str, max_new_tokens: int) -> list[int]:
    """Every step: the whole sequence through the model, then the best-scoring token whose bytes keep a viable
    prefix (or EOS where the text matches); stops at EOS or when nothing but EOS may follow."""
    sequence, text = list(prompt), b""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([sequence]), torch.arange(len(sequence))[None])[0, -1]
        for token in logits.argsort(descending=True, stable=True).tolist():
            if token == EOS:
                if re.fullmatch(pattern, text.decode(errors="replace"), re.ASCII) and b"\xef\xbf\xbd" not in text:
                    return sequence[len(prompt):] + [EOS]
                continue
            if viable(pattern, text + SMALL.token_bytes(token)):
                break
        sequence.append(token)
        text += SMALL.token_bytes(token)
        if not any(viable(pattern, text + SMALL.token_bytes(t)) for t in range(1, len(PIECES))):
            return sequence[len(prompt):]  # whole: only EOS could follow, and the package stops here
    return sequence[len(prompt):]


@pytest.mark.parametrize("pattern", [r"(yes|no)!{1,3}", r"[a-c]+\d{0,2}", r'"[^"\\]{0,6}"', r"[é日]+x?",
                                     r'\{"(name|age)": ?(-?[1-9][0-9]{0,3}|"[a-z ]{0,5}")\}'])
def test_greedy_constrained_equals_brute_force(tiny_kind, pattern):
    model = tiny_model(tiny_kind)
    prompt = SMALL.encode('{"name": "Al')
    expected = brute_force_greedy(model, prompt, pattern, 24)
    row = generate(model, prompt, tokenizer=SMALL, regex=pattern, max_new_tokens=24).rows[0]
    assert row.token_ids == expected
    if row.finish_reason != "length":
        assert re.fullmatch(pattern, row.text, re.ASCII), row.text


HELD_OUT_TINY = [  # written after the automaton was done, never used while developing it
    {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer"},
                                      "price": {"type": "number"}, "gift": {"type": "boolean"}},
     "required": ["sku", "qty", "price"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]},
        "label": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}}, "required": ["point", "label"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 4}}, "required": ["tags"]},
    {"$defs": {"pet": {"type": "object", "properties": {"kind": {"const": "cat"}, "age": {"type": "integer"}},
                       "required": ["kind"], "additionalProperties": False}},
     "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}},
     "required": ["pets"]},
    {"type": "object"},
]


@pytest.mark.parametrize("schema", HELD_OUT_TINY, ids=range(len(HELD_OUT_TINY)))
def test_every_tiny_model_output_parses_and_validates(schema):
    """Every output that ends parses and validates. A random model may write a string without end where the
    schema lets it (json_object's free strings): such an output, cut at max_new_tokens, must still be a prefix of
    valid JSON; where every string and list is bounded, every output ends."""
    bounded = schema != {"type": "object"}
    dfa = compile_dfa(schema_node(schema))
    model = tiny_model("llama", seed=3, tokenizer=FULL)
    prompts = [FULL.encode(text) for text in ("ab", '{"name": "x"}', "yes no")]
    configs = [SamplingConfig(max_new_tokens=200, json_schema=schema),
               *(SamplingConfig(max_new_tokens=200, json_schema=schema, do_sample=True, temperature=t, seed=s)
                 for t, s in ((1.0, 1), (1.0, 2), (0.7, 3), (1.5, 4)))]
    finished = 0
    for prompt in prompts:
        for config in configs:
            row = generate(model, prompt, config, tokenizer=FULL).rows[0]
            if row.finish_reason == "length" and not bounded:
                assert dfa.walk(dfa.start, b"".join(map(FULL.token_bytes, row.token_ids))) >= 0
                continue
            assert row.finish_reason in ("eos", "stop"), (row.text, row.finish_reason)
            jsonschema.validate(json.loads(row.text), schema)
            finished += 1
    assert finished >= (len(prompts) * len(configs) if bounded else 3)


def test_the_engine_gives_each_constrained_request_its_solo_tokens():
    """Continuous batching mixes constrained and free rows; each row's tokens are those generate gives it alone."""
    model = tiny_model("qwen2", seed=1, tokenizer=FULL)
    prompts = [FULL.encode(t) for t in ("ab", "yes", "x}", "12")]
    configs = [SamplingConfig(max_new_tokens=120, json_schema=HELD_OUT_TINY[0]),
               SamplingConfig(max_new_tokens=20),
               SamplingConfig(max_new_tokens=40, regex=r"(yes|no)!{1,3}", do_sample=True, seed=5),
               SamplingConfig(max_new_tokens=40, json_schema={"type": "object"}, do_sample=True, seed=6)]
    alone = [generate(model, p, c, tokenizer=FULL).rows[0].token_ids for p, c in zip(prompts, configs)]
    together = generate_continuous(model, prompts, configs, tokenizer=FULL)
    assert [row.token_ids for row in together.rows] == alone
    json.loads(together.rows[0].text)
    assert re.fullmatch(r"(yes|no)!{1,3}", together.rows[2].text)


def test_strategies_that_do_not_apply_the_mask_refuse_a_constraint():
    from minillm.strategies.beam import BeamSearchError, beam_search
    from minillm.strategies.drafters import PromptLookup
    from minillm.strategies.speculative import speculative_generate

    model, prompt = tiny_model(), SMALL.encode("yes")
    with pytest.raises(BeamSearchError, match="regex"):
        beam_search(model, [prompt], tokenizer=SMALL, regex="yes", num_beams=2)
    with pytest.raises(ValueError, match="structured output"):
        speculative_generate(model, prompt, PromptLookup(), SamplingConfig(json_schema={"type": "object"}),
                             tokenizer=SMALL)


def test_constraint_follows_eos_and_refuses_a_token_it_did_not_allow():
    index = token_index("regex", "ab", SMALL, len(PIECES))
    constraint = Constraint(index)
    assert not bool(constraint.mask()[EOS])
    constraint.advance(PIECES.index("ab"))
    assert constraint.complete and bool(constraint.mask()[EOS])
    with pytest.raises(ValueError, match="not allowed"):
        Constraint(index).advance(PIECES.index("b"))


# ------------------------------------------------------------------ the real model


HELD_OUT_REAL = [
    ("Give a book as JSON: its title, its author and the year it was published.",
     {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                       "year": {"type": "integer"}}, "required": ["title", "author", "year"]}),
    ("Is water wet? Answer as JSON with a boolean and a short reason.",
     {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 80}},
      "required": ["answer", "reason"], "additionalProperties": False}),
    ("List three primary colours as JSON.",
     {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "yellow", "blue",
                                                                                       "green"]},
                                                   "minItems": 3, "maxItems": 3}}, "required": ["colours"]}),
]


def test_real_model_outputs_parse_and_validate(default_model):
    model, tok = default_model
    for question, schema in HELD_OUT_REAL:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}])
        for options in ({}, {"do_sample": True, "temperature": 0.8, "seed": 7}):
            row = generate(model, prompt, tokenizer=tok, json_schema=schema, max_new_tokens=80, compile=False,
                           **options).rows[0]
            assert row.finish_reason in ("eos", "stop"), row.text
            jsonschema.validate(json.loads(row.text), schema)


# ------------------------------------------------------------------ the command line: --json-schema, --regex


def cli(capsys, *argv):
    from minillm.infer import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, named", [
    (["--json-schema", '{"type": "object", "not": {}}'], "not"),  # a keyword outside the subset, by name
    (["--json-schema", "no-such-schema.json"], "neither a JSON object nor a file"),
    (["--json-schema", '{"type": "object",'], "not valid JSON"),
    (["--regex", "a(?=b)"], "lookaround"),
    (["--regex", "[a-z]+", "--json-schema", '{"type": "string"}'], "None when json_schema is set"),
    (["--regex", "[a-z]+", "--speculative", "prompt-lookup"], "drop --speculative / --num-beams"),
    (["--regex", "[a-z]+", "--num-beams", "2"], "drop --speculative / --num-beams"),
])
def test_cli_refuses_a_constraint_it_cannot_apply_in_one_line_before_loading(capsys, argv, named):
    code, out, err = cli(capsys, "--prompt", "hi", "--model", "/no/such/model.gguf", *argv)  # never loaded
    assert code == 2 and out == "" and err.count("\n") == 1 and named in err, err


@pytest.mark.slow
@pytest.mark.real_model  # the CLI loads it
def test_cli_json_schema_from_a_file_and_regex_give_valid_answers(capsys, tmp_path):
    """The real model through the CLI: greedy and sampled answers parse and validate; a regex answer fullmatches."""
    question, schema = HELD_OUT_REAL[0]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for options in ([], ["--temperature", "0.8", "--seed", "3"]):
        code, out, err = cli(capsys, "--prompt", question, "--json-schema", str(path), "--json",
                             "--max-new-tokens", "80", "--eager", *options)
        record = json.loads(out)
        assert code == 0 and record["finish_reason"] in ("eos", "stop"), err
        jsonschema.validate(json.loads(record["text"]), schema)
    pattern = r"(yes|no), because [a-z ]{5,40}\."
    code, out, err = cli(capsys, "--prompt", "Is the sky blue?", "--regex", pattern, "--max-new-tokens", "40",
                         "--eager")
    assert code == 0 and re.fullmatch(pattern, out.removesuffix("\n")), (out, err)


# ------------------------------------------------------------------ the server: response_format


def response_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_server_response_format_json_schema_streaming_and_not():
    """Through the official client, every reply parses and validates (held-out schemas, greedy and sampled,
    streamed and whole); a streamed reply equals the whole one for the same seed."""
    from openai import OpenAI

    model = tiny_model("llama", seed=5, tokenizer=FULL)
    with BackgroundServer(model, FULL, model_name="tiny", max_num_seqs=4, num_blocks=128, block_size=8) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        for schema in HELD_OUT_TINY[:4]:
            settings = dict(model="tiny", messages=[{"role": "user", "content": "ab"}], max_tokens=200,
                            response_format=response_format(schema))
            replies = client.chat.completions.create(**settings, n=3, seed=11, temperature=1.0)
            greedy = client.chat.completions.create(**settings, temperature=0)
            for choice in [*replies.choices, *greedy.choices]:
                assert choice.finish_reason == "stop", choice.message.content
                jsonschema.validate(json.loads(choice.message.content), schema)
            stream = client.chat.completions.create(**settings, seed=11, temperature=1.0, stream=True)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            assert streamed == replies.choices[0].message.content
        json_mode = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=120, temperature=0.5, seed=3,
                                                   response_format={"type": "json_object"})
        reply = json_mode.choices[0]
        if reply.finish_reason == "stop":
            assert isinstance(json.loads(reply.message.content), dict)
        else:  # a random model may write an endless string: what it wrote is still a prefix of a JSON object
            dfa = compile_dfa(schema_node({"type": "object"}))
            assert dfa.walk(dfa.start, reply.message.content.encode()) >= 0


@pytest.mark.parametrize("fmt,named", [
    (response_format({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}),
     "'format'"),
    (response_format({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}), "'minimum'"),
    (response_format({"type": "object", "patternProperties": {"^a": {}}}), "'patternProperties'"),
    (response_format({"type": "object", "properties": {"s": {"type": "string", "minLength": 5000}}}),
     "'minLength' (at .properties.s) = 5000 is too large"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "xml"}, "'xml'"),
])
def test_server_refuses_what_it_cannot_constrain_with_a_400_naming_it(fmt, named):
    model = tiny_model("llama", seed=5, tokenizer=FULL)
    with BackgroundServer(model, FULL, model_name="tiny", max_num_seqs=2, num_blocks=32, block_size=8) as server:
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": "x"}], "response_format": fmt})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert named in error["message"] and error["param"] == "response_format", error
        free = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                "response_format": {"type": "text"}})
        assert free.status_code == 200, free.text


def test_real_model_server_json_modes(default_model):
    """SmolLM2 behind the server: json_object and a held-out json_schema, streamed and not, all parse and match."""
    from openai import OpenAI

    model, tok = default_model
    question, schema = HELD_OUT_REAL[0]
    with BackgroundServer(model, tok, kv_cache_mb=32) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model="default", messages=messages, max_tokens=80, temperature=0,
                                               response_format=response_format(schema, "book"))
        jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
        stream = client.chat.completions.create(model="default", messages=messages, max_tokens=80, temperature=0,
                                                response_format=response_format(schema, "book"), stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            whole.choices[0].message.content
        json_mode = client.chat.completions.create(  # room to close the object on any sampled path (threads change it)
            model="default", max_tokens=240, temperature=0.7, seed=2, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Describe a cat as a JSON object."}])
        assert json_mode.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(json_mode.choices[0].message.content), dict)


def test_notebook_runs(run_notebook):
    run_notebook("18_structured_output.ipynb", timeout=600)


# ------------------------------------------------------------------ tool calls: the reply constrained to a call


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
BRACES = {str(i): -100 for i, piece in enumerate(FULL.pieces) if piece.startswith(b"{")}  # "auto" without a call


def test_a_call_or_text_automaton_takes_the_call_branch_exactly_when_the_reply_opens_a_brace():
    from minillm.decoding.structured import constraint_dfa
    from minillm.serving.tools import Tools

    tools = Tools.from_request([WEATHER, TIME], "auto")
    dfa = constraint_dfa("json_schema_or_text", json.dumps(tools.call_schema()))
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    assert dfa.accepts(json.dumps(call).encode()) and dfa.accepts(b'{"name": "get_time", "arguments": {}}')
    assert dfa.accepts("It is sunny, {they say}.".encode())
    for bad in (b'{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}', b'{"x": 1}', b" {",
                b'{"name": "nope", "arguments": {}}'):
        assert not dfa.accepts(bad), bad
    assert tools.parse_call(json.dumps(call))["function"] == {"name": "get_weather",
                                                              "arguments": json.dumps(call["arguments"])}
    assert tools.parse_call("It is sunny") is None and tools.parse_call('{"name": "get_weather"') is None
    assert Tools.from_request([WEATHER], "none") is None and Tools.from_request(None, None) is None


def tool_model(seed: int):
    """Room for the tools' description in the prompt: a byte-level vocabulary spells it in hundreds of tokens."""
    return tiny_pair("llama", seed=seed, context_length=1024, vocab_size=FULL.vocab_size)[1]


def test_server_tool_calls_required_named_auto_and_streamed():
    model = tool_model(7)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with BackgroundServer(model, FULL, model_name="tiny", max_num_seqs=2, num_blocks=128, block_size=8) as server:
        def chat(**body):
            answer = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                json={"messages": messages, "max_tokens": 80, "temperature": 0, **body})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]

        for choice, names in (("required", {"get_weather", "get_time"}),
                              ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
            reply = chat(tools=[WEATHER, TIME], tool_choice=choice)
            (call,) = reply["message"]["tool_calls"]
            assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
            assert call["type"] == "function" and call["function"]["name"] in names and call["id"].startswith("call_")
            parameters = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
        text = chat(tools=[WEATHER], logit_bias=BRACES)  # "auto" (the default), a reply that does not open a brace
        assert text["message"]["content"] and "tool_calls" not in text["message"]
        assert text["finish_reason"] in ("stop", "length")

        streamed = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 80, "temperature": 0, "stream": True, "tools": [WEATHER, TIME],
            "tool_choice": "required"})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
        assert len(calls) == 1 and deltas[-1]["finish_reason"] == "tool_calls"
        assert calls[0][0]["function"] == chat(tools=[WEATHER, TIME], tool_choice="required")["message"][
            "tool_calls"][0]["function"]  # streamed as the whole answer gives it

        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
        followed = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": history, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "none"})
        assert followed.status_code == 200 and followed.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("body,named", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice 'sometimes' is invalid"),
    ({"tools": [{"type": "function"}]}, "tools[0] is invalid"),
    ({"tools": [WEATHER, WEATHER]}, "a second function named 'get_weather'"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "send one of them"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "format": "date"}}}}}]}, "'format'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "this server reads text"),
])
def test_server_refuses_tool_requests_it_cannot_serve_with_a_400_naming_why(body, named):
    model = tool_model(5)
    with BackgroundServer(model, FULL, model_name="tiny", max_num_seqs=2, num_blocks=128, block_size=8) as server:
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, **body})
        assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.text
