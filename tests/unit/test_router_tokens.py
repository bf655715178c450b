"""The characters-per-token bound behind the router's cheap "cannot possibly fit" check, and the
GIL-releasing encode it tokenizes with off the event loop."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from tandem.worker.model.tiny import write_tiny_model
from tandem.worker.model.tokenizer import Tokenizer
from tandem.worker.router.tokens import (
    MAX_CANONICAL_DECOMPOSITION,
    MAX_COMPATIBILITY_DECOMPOSITION,
    chars_per_token_bound,
    encode,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


def texts() -> list[str]:
    rng = random.Random(7)
    alphabet = "ab cd\n\t  éü東京🙂<|im_start|>" + "".join(chr(c) for c in range(0x300, 0x310))
    out = ["a" * 5000, " " * 5000, "<|im_start|>" * 300, "🙂" * 1000, "\u0301" * 2000]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(40)]
    return out


def test_tiny_tokenizer_bound_holds(tiny: Tokenizer) -> None:
    bound = chars_per_token_bound(tiny)
    assert bound is not None and bound >= max(len(t) for t in ["<|begin_of_text|>"])
    for text in texts():
        for special in (True, False):
            assert len(encode(tiny, text, special)) >= len(text) / bound


def test_encode_matches_and_leaves_other_threads_running(tiny: Tokenizer) -> None:
    text = "Zürich a b " * 40_000
    assert encode(tiny, text) == tiny.encode(text)
    assert encode(tiny, text, add_special_tokens=False) == tiny.encode(text, add_special_tokens=False)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    before = len(ticks)
    started = time.monotonic()
    encode(tiny, text * 3)
    took = time.monotonic() - started
    stop.set()
    thread.join()
    assert len(ticks) - before > 3 or took < 0.02  # the ticker ran while encode worked


def save(tok: HFTokenizer, folder: Path) -> Tokenizer:
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def bpe(byte_level: bool = True, **model: object) -> HFTokenizer:
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3}
    if byte_level:
        vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())} | {"ab": 300, "abab": 301}
    tok = HFTokenizer(models.BPE(vocab, [("a", "b")] if not byte_level else [("a", "b"), ("ab", "ab")], **model))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


@pytest.mark.parametrize(("name", "make", "expected"), [
    ("byte-level", lambda: bpe(), 4.0),
    ("nfc", lambda: _with(bpe(), normalizer=normalizers.NFC()), 4.0 * MAX_CANONICAL_DECOMPOSITION),
    ("nfkc", lambda: _with(bpe(), normalizer=normalizers.NFKC()), 4.0 * MAX_COMPATIBILITY_DECOMPOSITION),
    ("strip", lambda: _with(bpe(), normalizer=normalizers.Strip()), None),
    ("whitespace-split", lambda: _with(bpe(), pre_tokenizer=pre_tokenizers.WhitespaceSplit()), None),
    ("unk-dropped", lambda: bpe(byte_level=False), None),
    ("unk-fused", lambda: bpe(byte_level=False, unk_token="<unk>", fuse_unk=True), None),
    ("unk-per-char", lambda: bpe(byte_level=False, unk_token="<unk>"), 5.0),
    ("wordpiece", lambda: HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), None),
])
def test_bound_only_where_it_is_sound(tmp_path: Path, name: str, make: object, expected: float | None) -> None:
    assert callable(make)
    tok = save(make(), tmp_path / name)
    bound = chars_per_token_bound(tok)
    assert bound == expected
    if bound is not None:
        for text in texts():
            assert len(encode(tok, text)) >= len(text) / bound, text[:40]


def test_whitespace_swallowing_added_tokens_give_no_bound(tmp_path: Path) -> None:
    tok = bpe()
    tok.save(str(tmp_path / "t.json"))
    data = json.loads((tmp_path / "t.json").read_text())
    data["added_tokens"] = [{"id": 400, "content": "<mask>", "single_word": False, "lstrip": True, "rstrip": False,
                             "normalized": False, "special": True}]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(data))
    assert chars_per_token_bound(Tokenizer(tmp_path / "m")) is None


def test_decomposition_limits_match_unicodedata() -> None:
    nfd = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1))
    nfkd = max(len(unicodedata.normalize("NFKD", chr(c))) for c in range(sys.maxunicode + 1))
    assert (nfd, nfkd) == (MAX_CANONICAL_DECOMPOSITION, MAX_COMPATIBILITY_DECOMPOSITION)


def _with(tok: HFTokenizer, **parts: object) -> HFTokenizer:
    for key, value in parts.items():
        setattr(tok, key, value)
    return tok
