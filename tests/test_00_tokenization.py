"""Lesson 00: tokenization.

References: tiktoken's GPT-2 encoding (ranks from the openai-whisper sdist, as
`minillm.model.tokenizer.gpt2_tokenizer` loads them), the `tokenizers` library running
SmolLM2's tokenizer.json (the tokenizer the package loads), and transformers' chat-template
rendering. The texts below were written for these checks, not used while building
`minillm/model/bpe.py`.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model.bpe import (
    GPT2_PATTERN,
    BytePairEncoding,
    bpe_merge,
    bytes_to_unicode,
    merge_pair,
    spelled_bytes,
    train_bpe,
)
from minillm.model.chatml import SMOLLM2_CHAT_TEMPLATE, render_chatml
from minillm.model.tokenizer import gpt2_tokenizer, render_chat_template, render_jinja

HELD_OUT = [
    "Die Straßenbahn fährt um 07:45 Uhr ab — pünktlich, wie immer.",
    "L'été dernier, nous étions à Montréal ; c'était « magnifique » !",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον σκύλο.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आज मौसम अच्छा है।",
    "我们明天早上九点在图书馆见面。",
    "東京の天気は晴れ、最高気温は２８度です。",
    "오늘 저녁에 같이 밥 먹을래요?",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "שלום עולם, מה שלומך?",
    "Family: 👨‍👩‍👧‍👦, skin tones 👋🏿👋🏻, flags 🇯🇵🇧🇷, keycap 3️⃣, and 🫠.",
    "fn main() {\n\tlet v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}\n",
    '{"id": 42, "tags": ["a", "b"], "ok": true, "ratio": 0.125}',
    "    if x is not None:\n        return {k: v for k, v in x.items() if v}  # comment\n\n\n",
    "trailing spaces   \nCRLF line\r\nnbsp\u00a0here\u3000ideographic\u2003em\t\t\ttabs",
    "                                        forty spaces, then text",
    "DON'T SHOUT, she'd said; they've gone, we'll see, you're right, it's 'quoted'.",
    "e\u0301 (e + combining acute) vs é; ﬁ ligature; Å vs A\u030a; zero\u200bwidth\u200djoiner",
    "1234567890 3.14159 -0.5e-10 1,000,000 0x1F ①②③ ⅫⅣ",
    "<|endoftext|> in the middle <|endoftext|><|endoftext|>",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def tiktoken_gpt2():
    return gpt2_tokenizer().encoding


@pytest.fixture(scope="module")
def hand_gpt2(tiktoken_gpt2):
    return BytePairEncoding.from_tiktoken(tiktoken_gpt2)


# ------------------------------------------------------------------ the byte alphabet and training


def test_bytes_to_unicode_is_gpt2s_alphabet():
    from tokenizers import pre_tokenizers

    spelled = bytes_to_unicode()
    assert sorted(spelled) == list(range(256)) and len(set(spelled.values())) == 256
    assert set(spelled.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert all(c.isprintable() and not c.isspace() for c in spelled.values())
    assert spelled[ord(" ")] == "Ġ" and spelled[ord("\n")] == "Ċ" and spelled[ord("A")] == "A"
    assert spelled_bytes("Ġthe") == b" the" and spelled_bytes("Ã©") == "é".encode()


def test_training_learns_the_most_frequent_pair_first():
    """'aaabdaaabac' by hand: aa (4 times); then aa+a and a+b tie at 2 and the first seen wins; then aaa+b."""
    ranks, history = train_bpe("aaabdaaabac", 3)
    assert history == [((b"a", b"a"), 4), ((b"aa", b"a"), 2), ((b"aaa", b"b"), 2)]
    assert [token for token, rank in ranks.items() if rank >= 256] == [b"aa", b"aaa", b"aaab"]
    assert [ranks[b"aa"], ranks[b"aaa"], ranks[b"aaab"]] == [256, 257, 258]


def test_training_never_merges_across_pre_tokens():
    ranks, history = train_bpe("to be or not to be", 50)
    learned = [token for token, rank in ranks.items() if rank >= 256]
    assert b" be" in learned and b"to" in learned
    assert not [token for token in learned if b" " in token[1:]]  # a space only ever starts a token
    assert [count for _, count in history] == sorted((count for _, count in history), reverse=True)


TRAINING_TEXT = """Byte pair encoding starts from bytes and merges the pair that occurs most often, again and again,
until the vocabulary is as large as wanted. The merges are applied to new text in the order they were learned.
Frequent words become single tokens; rare words stay split into pieces; nothing is ever unknown."""


def test_encoding_the_training_text_repeats_the_training_merges():
    """Applying the learned ranks, lowest first, to each word gives the parts training ended with."""
    import regex

    ranks, history = train_bpe(TRAINING_TEXT, 120)
    merges = {pair: rank for rank, (pair, _) in enumerate(history)}
    for word in set(regex.findall(GPT2_PATTERN, TRAINING_TEXT)):
        parts = tuple(bytes([b]) for b in word.encode())
        for pair, _ in history:  # what training did: every merge, in order, over the whole word
            parts = merge_pair(parts, pair)
        assert tuple(bpe_merge(word.encode(), lambda a, b: merges.get((a, b)))) == parts, word


def test_trained_ranks_encode_like_tokenizers():
    """The merges learned here, handed to the `tokenizers` library's BPE, give the same ids on held-out text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    ranks, history = train_bpe(TRAINING_TEXT, 150)
    spell = bytes_to_unicode()
    as_text = lambda b: "".join(spell[x] for x in b)  # noqa: E731
    vocab = {as_text(token): rank for token, rank in ranks.items()}
    reference = Tokenizer(models.BPE(vocab=vocab, merges=[(as_text(a), as_text(b)) for (a, b), _ in history]))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    ours = BytePairEncoding(ranks)
    for text in HELD_OUT:
        assert ours.encode(text) == reference.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == text


# ------------------------------------------------------------------ GPT-2's ranks against tiktoken


@pytest.mark.parametrize("text", HELD_OUT)
def test_gpt2_by_hand_equals_tiktoken(hand_gpt2, tiktoken_gpt2, text):
    ours = hand_gpt2.encode(text)
    assert ours == tiktoken_gpt2.encode(text, allowed_special="all")
    assert hand_gpt2.encode_ordinary(text) == tiktoken_gpt2.encode_ordinary(text)
    assert [hand_gpt2.token_bytes(i) for i in ours] == [tiktoken_gpt2.decode_single_token_bytes(i) for i in ours]
    assert hand_gpt2.decode(ours) == text


def test_gpt2_tokens_that_split_a_character(hand_gpt2, tiktoken_gpt2):
    """Many tokens are part of a character: invalid UTF-8 alone, whole again when joined."""
    split = []
    for text in HELD_OUT:
        ids = hand_gpt2.encode(text)
        for k, i in enumerate(ids):
            try:
                hand_gpt2.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                split.append((text, k))
                # a cut after a partial character: the same bytes, and the same U+FFFD, as tiktoken
                assert hand_gpt2.decode_bytes(ids[:k + 1]) == tiktoken_gpt2.decode_bytes(ids[:k + 1])
                assert hand_gpt2.decode(ids[:k + 1]) == tiktoken_gpt2.decode(ids[:k + 1])
    assert len({text for text, _ in split}) >= 8, "the held-out texts should cut characters in many places"
    assert hand_gpt2.encode("🫠") == tiktoken_gpt2.encode("🫠") and len(hand_gpt2.encode("🫠")) > 1


@settings(max_examples=300)
@given(st.text(max_size=80))
def test_gpt2_by_hand_equals_tiktoken_on_random_text(hand_gpt2, tiktoken_gpt2, text):
    ours = hand_gpt2.encode_ordinary(text)
    assert ours == tiktoken_gpt2.encode_ordinary(text)
    assert hand_gpt2.decode(ours) == text


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=40))
def test_bpe_of_any_bytes_equals_tiktoken(hand_gpt2, tiktoken_gpt2, raw):
    """BPE itself (no regex) on bytes that need not be UTF-8: the same merges as tiktoken's core."""
    ours = hand_gpt2.encode_piece(raw)
    assert ours == tiktoken_gpt2._encode_single_piece(raw)
    assert hand_gpt2.decode_bytes(ours) == raw


# ------------------------------------------------------------------ the chat template


CONVERSATIONS = {
    "single turn": [{"role": "user", "content": "What is 2 + 2?"}],
    "single turn with system": [{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": "Good morning!"}],
    "multi turn": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."},
                   {"role": "user", "content": "Another one, please.\nJust one word."}],
    "multi turn with system": [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                               {"role": "user", "content": "{{ not a template }} <|im_end|> {% raw %}"}],
    "assistant first": [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}],
    "system only": [{"role": "system", "content": ""}],
    "empty": [],
}


def transformers_render(messages, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=SMOLLM2_CHAT_TEMPLATE,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_template_by_hand_equals_transformers(name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = render_chatml(messages, add_generation_prompt)
    assert ours == transformers_render(messages, add_generation_prompt)
    assert ours == render_jinja(SMOLLM2_CHAT_TEMPLATE, messages, add_generation_prompt)
    assert ours == render_chat_template(SMOLLM2_CHAT_TEMPLATE, messages, add_generation_prompt)  # the package's
    if name == "single turn" and add_generation_prompt:
        assert ours == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


turn = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                              "content": st.text(max_size=30)})


@settings(max_examples=200)
@given(st.lists(turn, max_size=5), st.booleans())
def test_chat_template_by_hand_equals_transformers_on_random_conversations(messages, add_generation_prompt):
    assert render_chatml(messages, add_generation_prompt) == transformers_render(messages, add_generation_prompt)


def test_chat_template_falls_back_to_jinja_where_python_would_differ():
    """Jinja refuses to add a number to a string; the package must too, not print it."""
    messages = [{"role": "user", "content": 5}]
    with pytest.raises(TypeError):
        render_jinja(SMOLLM2_CHAT_TEMPLATE, messages, True)
    with pytest.raises(TypeError):
        render_chat_template(SMOLLM2_CHAT_TEMPLATE, messages, True)


# ------------------------------------------------------------------ SmolLM2's tokenizer (the real files)


@pytest.fixture(scope="module")
def smollm2():
    """(the package's SmolLM2 tokenizer, the hand-built BPE from the same tokenizer.json, the folder)."""
    from minillm.model.loading import resolve_checkpoint_folder
    from minillm.model.tokenizer import tokenizer_from_folder

    folder = resolve_checkpoint_folder("default")
    return (tokenizer_from_folder(folder, "llama"), BytePairEncoding.from_tokenizer_json(folder / "tokenizer.json"),
            folder)


SMOLLM2_EXTRA = ["  2024-11-25 at 09:30, 3.5 kg, 1e6", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                 "<repo_name>minillm<file_sep>bpe.py", "control\x04bytes\x13are\x1ddropped ! \x06 !",
                 "plane 15 \U000f0041 and plane 4 \U00040000"]


@pytest.mark.real_model
@pytest.mark.parametrize("text", HELD_OUT + SMOLLM2_EXTRA)
def test_smollm2_by_hand_equals_tokenizers(smollm2, text):
    package, ours, _ = smollm2
    ids = ours.encode(text)
    assert ids == package.encode(text)
    assert ours.decode(ids) == package.decode(ids)
    assert [ours.token_bytes(i) for i in ids] == [package.token_bytes(i) for i in ids]


@pytest.mark.real_model
def test_smollm2_special_tokens_and_missing_bytes(smollm2):
    package, ours, _ = smollm2
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    digits = [ours.vocab[bytes([d])] for d in b"2024"]
    assert ours.encode("  2024") == package.encode("  2024") == [ours.vocab[b"  "], *digits]  # "  " then each digit
    assert len(ours.missing_bytes) == 21  # 6 control characters and 15 bytes no assigned character needs
    assert ours.decode(ours.encode("a\x04b")) == "ab" == package.decode(package.encode("a\x04b"))


@pytest.mark.real_model
@settings(max_examples=300)
@given(st.text(max_size=80))
def test_smollm2_by_hand_equals_tokenizers_on_random_text(smollm2, text):
    package, ours, _ = smollm2
    assert ours.encode(text) == package.encode(text)


@pytest.mark.real_model
def test_smollm2_chat_prompt_equals_transformers_apply_chat_template(smollm2):
    """The package's chat prompt (rendered by hand, tokenized by hand) equals transformers' on the real files."""
    from transformers import AutoTokenizer

    package, ours, folder = smollm2
    reference = AutoTokenizer.from_pretrained(folder)
    assert reference.chat_template == package.chat_template == SMOLLM2_CHAT_TEMPLATE
    conversations = [messages for messages in CONVERSATIONS.values() if messages]  # transformers refuses []
    for messages, add_generation_prompt in itertools.product(conversations, (True, False)):
        text = package.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False)
        expected_ids = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False)
        assert ours.encode(text) == package.encode(text) == list(expected_ids)


def test_notebook_runs(run_notebook):
    run_notebook("00_tokenization.ipynb")
