"""A tokenizer directory with missing or unreadable files is one ConfigError naming what is missing."""

from __future__ import annotations

import json

import pytest

from offload import ConfigError
from offload.tokenizer_files import check_tokenizer_dir


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
