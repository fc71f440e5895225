"""offload.data_files: a data file's format comes from its suffix and its content, never a guess.

A renamed .jsonl read as .json gives its records (not its JSON syntax as text); an unknown suffix or
content no format can read is one error naming the file, unless the format is said outright."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import ConfigError
from offload.data import load_data
from offload.data_files import read_data_file

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
RECORDS = st.one_of(
    st.lists(st.builds(lambda t: {"text": t}, TEXT.filter(str.strip)), min_size=1, max_size=6),
    st.lists(st.builds(lambda p, c: {"prompt": p, "completion": c}, TEXT, TEXT), min_size=1, max_size=6),
    st.lists(st.builds(lambda c: {"messages": [{"role": "user", "content": c}]}, TEXT), min_size=1, max_size=6),
)
# What editors and tools put around the records: a BOM, leading blank lines and spaces.
LEAD = st.tuples(st.sampled_from(["", "\ufeff"]), st.sampled_from(["", "\n", "  \n\n", " \t"]))


def as_lines(records, lead=("", ""), blank_every=0):
    lines = [json.dumps(r) for r in records]
    if blank_every:
        lines = [x for i, line in enumerate(lines) for x in ([line, ""] if i % blank_every == 0 else [line])]
    return lead[0] + lead[1] + "\n".join(lines) + "\n"


def as_array(records, lead=("", ""), indent=None):
    return lead[0] + lead[1] + json.dumps(records, indent=indent) + "\n"


def fields(data):
    return [r.fields for r in data.records]


@settings(max_examples=40, deadline=None)
@given(records=RECORDS, lead=LEAD, blank_every=st.integers(0, 3))
def test_json_lines_read_as_records_under_either_suffix(tmp_path_factory, records, lead, blank_every):
    """Issue 26 point 1: a .jsonl renamed .json is still records, not text."""
    d = tmp_path_factory.mktemp("d")
    for name in ("data.jsonl", "data.json", "DATA.JSON"):
        (d / name).write_text(as_lines(records, lead, blank_every), encoding="utf-8")
        data = read_data_file(d / name)
        assert data.format == "jsonl" and data.text is None
        assert fields(data) == records


@settings(max_examples=40, deadline=None)
@given(records=RECORDS, lead=LEAD, indent=st.sampled_from([None, 0, 2]))
def test_json_arrays_read_as_records_and_numbered_by_position(tmp_path_factory, records, lead, indent):
    path = tmp_path_factory.mktemp("d") / "data.json"
    path.write_text(as_array(records, lead, indent), encoding="utf-8")
    data = read_data_file(path)
    assert data.format == "json" and fields(data) == records
    assert [r.number for r in data.records] == list(range(1, len(records) + 1))
    assert read_data_file(path, "json").records == data.records


@settings(max_examples=25, deadline=None)
@given(records=RECORDS, lead=LEAD)
def test_an_array_is_not_json_lines(tmp_path_factory, records, lead):
    path = tmp_path_factory.mktemp("d") / "data.jsonl"
    path.write_text(as_array(records, lead), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"data\.jsonl': starts with '\[': a JSON array, not one JSON object a line"):
        read_data_file(path)


@settings(max_examples=25, deadline=None)
@given(body=st.one_of(TEXT, RECORDS.map(as_lines)), suffix=st.sampled_from(["", ".csv", ".md", ".jsonl.gz"]))
def test_an_unknown_suffix_is_an_error_unless_text_is_asked_for(tmp_path_factory, body, suffix):
    path = tmp_path_factory.mktemp("d") / f"data{suffix}"
    path.write_text(body + "x", encoding="utf-8")
    with pytest.raises(ConfigError, match="--data-format text") as err:
        read_data_file(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert read_data_file(path, "text").text == body + "x"


@settings(max_examples=25, deadline=None)
@given(body=st.one_of(TEXT.filter(str.strip), RECORDS.map(as_lines), RECORDS.map(as_array)), bom=st.booleans())
def test_txt_is_text_whatever_it_holds(tmp_path_factory, body, bom):
    path = tmp_path_factory.mktemp("d") / "notes.txt"
    path.write_text(("\ufeff" if bom else "") + body, encoding="utf-8")
    assert read_data_file(path).text == body           # the BOM is the encoding's, not the text's


@settings(max_examples=25, deadline=None)
@given(blank=st.sampled_from(["", "\n", " \n\t\n", "\ufeff", "\ufeff\n  "]),
       name=st.sampled_from(["a.txt", "a.json", "a.jsonl"]), fmt=st.sampled_from(["auto", "text", "json", "jsonl"]))
def test_empty_files_are_empty_in_every_format(tmp_path_factory, blank, name, fmt):
    path = tmp_path_factory.mktemp("d") / name
    path.write_text(blank, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"a\.(txt|json|jsonl)': is empty"):
        read_data_file(path, fmt)


@pytest.mark.parametrize("body,match", [
    ("hello world\n", r"a\.json': is neither a JSON array nor JSON lines: it starts with 'hello world'"),
    ('{\n  "text": "a"\n}\n', r"a\.json': holds one JSON object spanning lines"),
    ('[{"text": "a"}, 3]', r"a\.json record 2': expected a JSON object"),
    ('[{"text": "a"}, {"prompt": "b", "completion": "c"}]', r"a\.json record 2': is a prompt/completion record; "
                                                            r"record 1 was text"),
    ("[]", r"a\.json': has no records \(an empty JSON array\)"),
    ('[{"text": "a"},', r"a\.json:1': is not a JSON array"),
    ('{"text": "a"}\nnot json\n', r"a\.json:2': is not JSON"),
])
def test_undecidable_or_broken_json_names_file_and_place(tmp_path, body, match):
    path = tmp_path / "a.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match) as err:
        read_data_file(path)
    assert "\n" not in str(err.value) and err.value.field == "--data"


def test_the_format_said_outright_wins_over_the_suffix(tmp_path):
    path = tmp_path / "chat.txt"
    path.write_text(as_lines([{"text": "ab"}, {"text": "cd"}]))
    assert read_data_file(path).text is not None
    assert fields(read_data_file(path, "jsonl")) == [{"text": "ab"}, {"text": "cd"}]
    with pytest.raises(ConfigError, match="--data-format.*auto, text, jsonl, json") as err:
        read_data_file(path, "csv")
    assert err.value.field == "--data-format"


def test_load_data_reads_a_renamed_jsonl_as_its_records(tmp_path):
    """The end of issue 26 point 1: the tokens are the records' text, not the JSON syntax."""
    path = tmp_path / "chat.json"
    path.write_text(as_lines([{"prompt": "Q ", "completion": "A"}, {"prompt": "R ", "completion": "B"}]))
    data = load_data(path)
    assert data.kind == "prompt/completion" and len(data.examples) == 2
    assert data.examples[0][0].tolist() == list(b"Q A")
    with pytest.raises(ConfigError, match=r"data\.csv': has the suffix '\.csv'"):
        (tmp_path / "data.csv").write_text("a,b\n1,2\n")
        load_data(tmp_path / "data.csv")
    assert load_data(tmp_path / "data.csv", data_format="text").stream.tolist() == list(b"a,b\n1,2\n")


def test_chat_messages_in_a_json_array_need_a_chat_template(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(as_array([{"messages": [{"role": "user", "content": "x"}]}]))
    with pytest.raises(ConfigError, match=r"chat\.json record 1': has chat 'messages'.*chat template"):
        load_data(path)
