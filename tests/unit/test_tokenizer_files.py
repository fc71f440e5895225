"""A tokenizer directory with missing or unreadable files is one ConfigError naming what is missing;
a directory with no tokenizer at all is an error too, unless bytes were asked for."""

from __future__ import annotations

import json

import pytest

from offload import ConfigError
from offload.data import load_data, load_tokenizer
from offload.tokenizer_files import ByteTokenizer, check_tokenizer_dir


def test_complete_sets_pass(tmp_path):
    for files in (["tokenizer.json"], ["tokenizer.model"], ["vocab.json", "merges.txt"], ["vocab.txt"]):
        d = tmp_path / "_".join(files)
        d.mkdir()
        for f in files:
            (d / f).write_text("{}" if f.endswith(".json") else "x")
        assert check_tokenizer_dir(d) == d


@pytest.mark.parametrize("files,expect", [
    ([], "is missing the tokenizer files"),
    (["tokenizer_config.json"], "is missing the tokenizer files"),
    (["vocab.json"], "but not merges.txt"),
    (["merges.txt"], "but not vocab.json"),
])
def test_missing_files_are_named(tmp_path, files, expect):
    for f in files:
        (tmp_path / f).write_text("{}")
    with pytest.raises(ConfigError, match=expect) as info:
        check_tokenizer_dir(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    assert info.value.field == "--tokenizer"


def test_unreadable_json_and_not_a_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ConfigError, match="tokenizer.json cannot be read as JSON"):
        check_tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {}}))
    with pytest.raises(ConfigError, match="is not a directory"):
        check_tokenizer_dir(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="does not exist"):
        check_tokenizer_dir(tmp_path / "nope")


# ---- load_tokenizer: no silent fall back to bytes (issue 26 point 2) ---------------------------
def saved_tokenizer(directory):
    """A small byte-level BPE tokenizer trained here and saved as a Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "</s>"])
    tok.train_from_iterator(["hello world"] * 10, trainer)
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    out.save_pretrained(directory)
    return out


def model_dir_without_tokenizer(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128256}))
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_a_model_directory_without_tokenizer_files_is_an_error_naming_it(tmp_path):
    d = model_dir_without_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="has no tokenizer files") as err:
        load_tokenizer(d, "--model")
    msg = str(err.value)
    assert err.value.field == "--model" and str(d) in msg and "\n" not in msg
    assert "--tokenizer DIR" in msg and "--byte-tokens" in msg and "config.json" in msg


def test_no_directory_needs_bytes_asked_for(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer given.*--byte-tokens"):
        load_tokenizer(None)


def test_bytes_when_asked_for_and_only_then(tmp_path):
    d = model_dir_without_tokenizer(tmp_path)
    for directory in (None, d):
        tok = load_tokenizer(directory, "--model", allow_bytes=True)
        assert isinstance(tok, ByteTokenizer) and len(tok) == 256
        assert tok("hé")["input_ids"] == list("hé".encode())
    with pytest.raises(ConfigError, match="--byte-tokens.*raw bytes need 256 token ids; the model's vocabulary is 100"):
        load_tokenizer(d, "--model", allow_bytes=True, vocab_size=100)


def test_bytes_read_data_the_way_no_tokenizer_does(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "Q ", "completion": "A"}\n')
    mine, default = load_data(path, ByteTokenizer()), load_data(path)
    assert mine.vocab_size == default.vocab_size == 256
    assert [(i.tolist(), l.tolist()) for i, l in mine.examples] == [(i.tolist(), l.tolist()) for i, l in default.examples]


def test_a_directory_with_a_tokenizer_gives_it_even_when_bytes_are_allowed(tmp_path):
    saved = saved_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok", allow_bytes=True, vocab_size=len(saved))
    assert not isinstance(tok, ByteTokenizer) and len(tok) == len(saved)
    assert tok("hello world")["input_ids"] == saved("hello world")["input_ids"]
    with pytest.raises(ConfigError, match=f"--tokenizer.*has {len(saved)} tokens; the model's vocabulary is 10$"):
        load_tokenizer(tmp_path / "tok", vocab_size=10)


def test_a_half_tokenizer_names_its_missing_file(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ConfigError, match="has vocab.json but not merges.txt"):
        load_tokenizer(tmp_path, "--model", allow_bytes=True)
