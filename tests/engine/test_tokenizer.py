"""Tokenizer, chat template and streaming detokenization across multi-byte characters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.worker.engine.detokenizer import OutputText
from tandem.worker.model.tokenizer import Tokenizer

TEXTS = ["héllo wörld", "東京で🙂 and 🚀🚀", "naïve café, Москва!", "plain ascii text"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decoded_text_and_never_shows_partial_characters(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    detok = tokenizer.new_detokenizer(context_ids=tokenizer.encode("prompt: "))
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas  # some token ended mid-character and its text was held back


def test_stop_string_split_across_tokens_is_held_back(tokenizer: Tokenizer) -> None:
    text = "abc STOP def"
    out = OutputText(tokenizer.new_detokenizer(), stop=["STOP"])
    streamed, stopped = "", False
    for i in tokenizer.encode(text, add_special_tokens=False):
        stopped = out.push(i)
        streamed += out.take_delta(finished=stopped)
        if stopped:
            break
    assert stopped and streamed == "abc " and out.text == "abc "


def test_chat_template_and_special_tokens(tokenizer: Tokenizer) -> None:
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi 🙂"}])
    assert rendered == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 0 and ids.count(2) == 3  # special tokens are single ids
    assert tokenizer.eos_token_ids == {1, 3}
    with pytest.raises(ValueError, match="list of"):
        tokenizer.apply_chat_template(["not a message"])


def test_missing_tokenizer_and_template_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tiny_model_dir / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_word_initial_spaces_survive_for_sentencepiece_style_tokenizers(tmp_path: Path) -> None:
    """Metaspace tokenizers drop the space of a text's first word when decoding it alone; the
    detokenizer decodes new tokens together with the tokens before them, so a continuation keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 5,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    prompt = tokenizer.encode("hello world,")
    continuation = tokenizer.encode("hello world, the quick fox")[len(prompt):]
    assert tokenizer.decode(continuation) == "the quick fox"  # decoded alone: the leading space is gone
    detok = tokenizer.new_detokenizer(prompt)
    assert "".join(detok.push(t) for t in continuation) == " the quick fox"


# Written for this test (no copy of a published template): the features published templates use, loop
# controls, raise_exception, tojson with its options, a system prompt taken out of the loop, trimming.
FEATURE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}\
{% set rest = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}{% set rest = messages %}{% endif %}
<<SYS>>{{ system }}<</SYS>>
{% for m in rest %}
  {% if m['role'] == 'system' %}{{ raise_exception('only the first message may be a system message') }}{% endif %}
  {% if m['content'] == 'STOP' %}{% break %}{% endif %}
  {% if m['content'] == 'SKIP' %}{% continue %}{% endif %}
[{{ m['role'] }}] {{ m['content'] }} {{ {'n': loop.index, 'r': m['role']} | tojson(sort_keys=True) }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""


# Written for this test: a tools block that opens only when the request has tools, the way Mistral-style
# templates test for them (`tools is not none`), and a documents block likewise.
TOOLS_TEMPLATE = """{%- if tools is not none %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif -%}
{%- if documents is not none %}[DOCS]{{ documents | length }}[/DOCS]{% endif -%}
{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] }}
{% endfor %}"""


def test_tools_and_documents_are_none_when_absent_as_in_transformers(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    ours = Tokenizer(tiny_model_dir)
    ours.chat_template = TOOLS_TEMPLATE
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = theirs.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tokenize=False)
    assert "[TOOLS]" not in plain and "[DOCS]" not in plain
    assert ours.apply_chat_template(messages) == plain
    with_tools = theirs.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tokenize=False, tools=tools)
    assert ours.apply_chat_template(messages, tools=tools) == with_tools


def test_chat_template_renders_as_transformers_does(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    ours = Tokenizer(tiny_model_dir)
    ours.chat_template = FEATURE_TEMPLATE
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "SKIP"}, {"role": "user", "content": "Zürich"},
                {"role": "user", "content": "STOP"}, {"role": "user", "content": "never shown"}]
    for msgs in (messages, messages[1:]):
        for gen in (True, False):
            expected = theirs.apply_chat_template(msgs, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                                  add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expected
    with pytest.raises(ValueError, match="only the first message may be a system message"):
        ours.apply_chat_template([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])
