"""An output carries the tokenizer the run trained with: --tokenizer's files, not the --model
directory's (which may have none)."""

from __future__ import annotations

from offload.hf.export import support_files


def _dir(path, files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_the_tokenizer_directory_replaces_the_sources_tokenizer_files(tmp_path):
    model = _dir(tmp_path / "model", {"config.json": "{}", "model.safetensors": "", "generation_config.json": "{}",
                                      "tokenizer.json": "old", "vocab.json": "old", "merges.txt": "old"})
    tok = _dir(tmp_path / "tok", {"tokenizer.json": "new", "tokenizer_config.json": "new", "config.json": "{}",
                                  "chat_template.jinja": "new"})
    got = {f.name: f.read_text() for f in support_files(model, tokenizer=tok)}
    assert got == {"generation_config.json": "{}", "tokenizer.json": "new", "tokenizer_config.json": "new",
                   "chat_template.jinja": "new"}


def test_a_model_directory_without_a_tokenizer_gets_the_one_trained_with(tmp_path):
    model = _dir(tmp_path / "model", {"config.json": "{}", "model.safetensors": ""})
    tok = _dir(tmp_path / "tok", {"tokenizer.json": "new"})
    assert [f.name for f in support_files(model, tokenizer=tok)] == ["tokenizer.json"]
    assert [f.name for f in support_files(None, tokenizer=tok)] == ["tokenizer.json"]      # a preset run
    assert support_files(model) == []
