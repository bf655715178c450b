"""Grammar-constrained decoding in the engine (structured outputs): outputs follow their schema with a
random-weight model, the grammar's state crosses the prefill -> decode hand-off and a migration, and the
requests batched next to a constrained one sample exactly what they sample without it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from tandem.worker.engine import EngineConfig, LLMEngine, SamplingParams

from .conftest import random_prompts, run_requests, tokens_of

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), kv_cache_bytes=1 << 22))


def _schema_params(seed: int, schema: dict[str, Any] = PERSON, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=("json_schema", json.dumps(schema)), **kw)


def test_seeded_outputs_validate_against_the_schema(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    [prompt] = random_prompts((9,))
    outs = run_requests(engine, {f"r{s}": (prompt, _schema_params(s)) for s in range(4)})
    texts = []
    for rid, out in outs.items():
        assert out[-1].finish_reason == "stop", rid
        text = engine.tokenizer.decode(tokens_of(out))
        jsonschema_rs.validate(PERSON, json.loads(text))
        texts.append(text)
    assert len(set(texts)) > 1  # the seeds still choose: the grammar narrows, it does not decide


def test_requests_beside_a_constrained_one_sample_the_same_tokens(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    prompts = random_prompts((7, 12, 5))
    free = {"greedy": (prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
            "seeded": (prompts[1], SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True))}
    alone = run_requests(engine, free)
    mixed = run_requests(engine, {**free, "schema": (prompts[2], _schema_params(3))})
    for rid in free:
        assert tokens_of(mixed[rid]) == tokens_of(alone[rid]), rid
    jsonschema_rs.validate(PERSON, json.loads(engine.tokenizer.decode(tokens_of(mixed["schema"]))))


def test_grammar_state_crosses_the_prefill_to_decode_hand_off(tiny_model_dir: Path) -> None:
    """The prefill engine samples the first token under the grammar; the decode engine's matcher is fed it
    (add_prefilled_request) before masking the rest: the output equals one engine's."""
    [prompt] = random_prompts((10,), seed=3)
    params = _schema_params(11)
    whole = tokens_of(run_requests(_engine(tiny_model_dir), {"r": (prompt, params)})["r"])
    prefill = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1 << 22, role="prefill"))
    decode = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1 << 22, role="decode"))
    prefill.add_request("r", prompt, params)
    [first] = list(prefill.iter_outputs())
    dst = decode.reserve_kv("r", len(prompt))
    assert dst is not None and first.kv_block_ids is not None
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, first.kv_block_ids]  # what a transport does
    prefill.release_kv("r")
    decode.add_prefilled_request("r", prompt, first.new_token_ids[0], params)
    rest = [t for out in decode.iter_outputs() for t in out.new_token_ids]
    assert first.new_token_ids + rest == whole
    jsonschema_rs.validate(PERSON, json.loads(decode.tokenizer.decode(whole)))


def test_grammar_state_is_rebuilt_on_migration(tiny_model_dir: Path) -> None:
    """A request that moves after 5 tokens arrives with them at the end of its prompt (sampled_before=5):
    the new engine's matcher follows them and the continuation equals one engine's."""
    [prompt] = random_prompts((10,), seed=3)
    params = _schema_params(11)
    whole = tokens_of(run_requests(_engine(tiny_model_dir), {"r": (prompt, params)})["r"])
    moved = SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - 5})
    engine = _engine(tiny_model_dir)
    engine.add_request("r", prompt + whole[:5], moved, sampled_before=5)
    assert whole[:5] + [t for out in engine.iter_outputs() for t in out.new_token_ids] == whole


def test_tokens_produced_elsewhere_that_break_the_grammar_are_refused(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    [prompt] = random_prompts((6,))
    bad = engine.tokenizer.encode("x", add_special_tokens=False)  # no JSON object starts with x
    with pytest.raises(ValueError, match="does not follow"):
        engine.add_request("r", prompt + bad, _schema_params(1), sampled_before=len(bad))


@pytest.mark.parametrize(("kind", "spec", "check"), [
    ("json_object", "", lambda text: isinstance(json.loads(text), dict)),
    ("regex", r"[0-9]{3}-[a-z]{2}", lambda text: len(text) == 6 and text[3] == "-" and text[:3].isdigit()),
    ("choice", json.dumps(["yes", "no", "maybe not"]), lambda text: text in ("yes", "no", "maybe not")),
])
def test_other_grammar_kinds(tiny_model_dir: Path, kind: str, spec: str, check: Any) -> None:
    engine = _engine(tiny_model_dir)
    [prompt] = random_prompts((6,))
    for seed in range(3):
        [out] = engine.generate([prompt], SamplingParams(max_tokens=100, seed=seed, grammar=(kind, spec)))
        assert check(engine.tokenizer.decode(out)), engine.tokenizer.decode(out)


@pytest.mark.parametrize(("spec", "problem"), [
    ('{"type": "nonsense"}', "nonsense"), ('{"type": ', "JSON"),
])
def test_an_invalid_schema_is_a_value_error_naming_the_problem(tiny_model_dir: Path, spec: str, problem: str) -> None:
    engine = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match=problem) as info:
        engine.add_request("r", [5, 6], SamplingParams(grammar=("json_schema", spec)))
    assert "cpp" not in str(info.value)  # xgrammar's source locations stay out of the message
    assert not engine.has_unfinished_requests()


def test_an_engine_start_builds_no_vocabulary_table(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar's vocabulary table (every token's string) is built with the first grammar, not at every
    start: an engine whose requests bring none never pays for it (about 0.17 s per start for 128k tokens)."""
    from tandem.worker.model.tokenizer import Tokenizer

    built: list[int] = []
    original = Tokenizer.encoded_vocab

    def counted(self: Tokenizer) -> list[str]:
        built.append(1)
        return original(self)

    monkeypatch.setattr(Tokenizer, "encoded_vocab", counted)
    engine = _engine(tiny_model_dir)
    [prompt] = random_prompts((6,))
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    assert built == []
    [out] = engine.generate([prompt], SamplingParams(max_tokens=60, seed=1, grammar=("json_object", "")))
    assert built == [1] and isinstance(json.loads(engine.tokenizer.decode(out)), dict)


def test_grammars_need_no_private_xgrammar_helper(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only xgrammar's public API: an xgrammar without the private TokenizerInfo._detect_metadata_from_hf
    (it is not promised to stay) still constrains the output."""
    import xgrammar as xgr

    if hasattr(xgr.TokenizerInfo, "_detect_metadata_from_hf"):
        monkeypatch.delattr(xgr.TokenizerInfo, "_detect_metadata_from_hf")
    engine = _engine(tiny_model_dir)
    [prompt] = random_prompts((9,))
    [out] = engine.generate([prompt], _schema_params(2))
    jsonschema_rs.validate(PERSON, json.loads(engine.tokenizer.decode(out)))


def test_an_xgrammar_that_cannot_be_imported_is_a_clear_error(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.worker.engine.grammar import GrammarsUnavailable

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    engine = _engine(tiny_model_dir)
    with pytest.raises(GrammarsUnavailable, match=r"structured outputs are not available on this worker: xgrammar "
                                                  r"cannot be imported .*install xgrammar>=0\.2\.9"):
        engine.add_request("r", [5, 6], _schema_params(1))
    assert not engine.has_unfinished_requests()
    [out] = engine.generate([[5, 6]], SamplingParams(max_tokens=3, temperature=0))  # the rest goes on
    assert len(out) == 3


def _tokenizer_json(kind: str) -> str:
    """tokenizer.json of the shapes published models use, built with `tokenizers` (no Hub here)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    from tandem.worker.model.tiny import build_tokenizer

    sp_decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    if kind == "byte-level":  # Llama 3, Qwen 2: ByteLevel pre-tokenizer and decoder
        return build_tokenizer().to_str()
    tok = Tokenizer(models.BPE(vocab={"a": 0, "\u2581": 1}, merges=[], byte_fallback=True))
    if kind == "prepend-normalizer":  # Llama 2, Mistral v0.1: Prepend + Replace normalizers
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = sp_decoder
    elif kind.startswith("metaspace-"):  # later SentencePiece conversions: a Metaspace pre-tokenizer
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=kind.split("-")[1])
        tok.decoder = sp_decoder
    elif kind == "byte-level-in-sequence":
        tok.decoder = decoders.Sequence([decoders.Strip(" ", 0, 0), decoders.ByteLevel()])
    elif kind == "raw":  # no byte decoder at all
        tok = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return str(tok.to_str())


@pytest.mark.parametrize("kind", ["byte-level", "prepend-normalizer", "metaspace-first", "metaspace-always",
                                  "metaspace-never", "byte-level-in-sequence", "raw"])
def test_vocab_metadata_reads_tokenizer_json_as_xgrammar_does(kind: str) -> None:
    """grammar.vocab_metadata against xgrammar's own (private) detection, while the installed xgrammar has it:
    an xgrammar whose rules change shows here."""
    import xgrammar as xgr

    from tandem.worker.engine.grammar import vocab_metadata

    expected = {"byte-level": ("BYTE_LEVEL", False), "prepend-normalizer": ("BYTE_FALLBACK", True),
                "metaspace-first": ("BYTE_FALLBACK", True), "metaspace-always": ("BYTE_FALLBACK", True),
                "metaspace-never": ("BYTE_FALLBACK", False), "byte-level-in-sequence": ("BYTE_LEVEL", False),
                "raw": ("RAW", False)}[kind]
    backend = _tokenizer_json(kind)
    assert vocab_metadata(backend) == expected
    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is None:
        pytest.skip("the installed xgrammar has no _detect_metadata_from_hf to compare with")
    theirs = detect(backend)
    assert (theirs["vocab_type"].name, theirs["add_prefix_space"]) == expected
