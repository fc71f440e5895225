"""offload.data: the formats, their labels, the one-line errors, and the position checkpoints carry."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import ConfigError
from offload.data import IGNORE, Batches, load_data, shard_rows

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}</s>"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A small byte-level BPE tokenizer trained here, with a chat template (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "</s>", "<|user|>", "<|system|>", "<|assistant|>"])
    tok.train_from_iterator(["hello world, how are you? fine thanks"] * 20, trainer)
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    out.chat_template = TEMPLATE
    return out


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


def test_text_file_is_one_byte_stream(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("abcdefghij" * 5)
    data = load_data(path)
    assert data.kind == "stream" and data.vocab_size == 256
    ids, labels = Batches(data, 2, 8).next()
    assert ids.tolist()[0] == list(b"abcdefgh") and ids.tolist()[1] == list(b"ijabcdef")
    assert torch.equal(ids, labels)


def test_jsonl_text_records_join_into_a_stream(tmp_path):
    data = load_data(write(tmp_path, "t.jsonl", [{"text": "ab"}, "", {"text": "cd"}]))
    assert data.stream.tolist() == list(b"ab\n\ncd")


def test_prompt_completion_labels_only_the_completion(tmp_path):
    data = load_data(write(tmp_path, "pc.jsonl", [{"prompt": "Q: 1+1? ", "completion": "2"},
                                                  {"prompt": "Q: hi ", "completion": "hello"}]))
    ids, labels = Batches(data, 2, 12).next()
    assert ids[0, :9].tolist() == list(b"Q: 1+1? 2")
    assert labels[0].tolist() == [IGNORE] * 8 + [ord("2")] + [IGNORE] * 3      # prompt and padding ignored
    assert labels[1].tolist() == [IGNORE] * 6 + list(b"hello") + [IGNORE]


def test_chat_messages_label_only_assistant_turns(tmp_path, chat_tokenizer):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "world"}, {"role": "user", "content": "how are you?"},
            {"role": "assistant", "content": "fine thanks"}]
    data = load_data(write(tmp_path, "chat.jsonl", [{"messages": conv}]), chat_tokenizer)
    ids, labels = data.examples[0]
    assert ids.tolist() == chat_tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    learned = chat_tokenizer.decode([i for i, l in zip(ids.tolist(), labels.tolist()) if l != IGNORE])
    assert learned == "world</s>fine thanks</s>"     # the assistant text and its end, no headers or user text


def test_chat_without_template_is_an_error(tmp_path):
    path = write(tmp_path, "chat.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ConfigError, match=r"chat.jsonl:1.*chat template"):
        load_data(path)


@pytest.mark.parametrize("lines,match", [
    ([], r"empty\.jsonl.* is empty"),
    (["", "  "], r"empty\.jsonl.* is empty"),
    ([{"text": ""}], r"empty\.jsonl.*no usable record"),
    ([{"prompt": "a", "completion": ""}], r"empty\.jsonl.*no usable record"),
    ([{"text": "a"}, "{not json"], r"empty\.jsonl:2.*not JSON"),
    ([{"text": "a"}, {"title": "b"}], r"empty\.jsonl:2.*expected a JSON object"),
    ([{"text": "a"}, {"prompt": "b", "completion": "c"}], r"empty\.jsonl:2.*one kind per file"),
])
def test_bad_jsonl_files_name_file_and_line(tmp_path, lines, match):
    path = write(tmp_path, "empty.jsonl", lines)
    with pytest.raises(ConfigError, match=match) as err:
        load_data(path)
    assert "\n" not in str(err.value)


def test_unreadable_and_missing_files(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe not utf-8")
    with pytest.raises(ConfigError, match=r"bad\.txt \(byte 3\).*not UTF-8"):
        load_data(bad)
    with pytest.raises(ConfigError, match="is not a file"):
        load_data(tmp_path / "absent.txt")
    (tmp_path / "e.txt").write_text("\n \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_data(tmp_path / "e.txt")


@settings(max_examples=15, deadline=None)
@given(n_records=st.integers(1, 7), rows=st.integers(1, 4), stop=st.integers(0, 9))
def test_restored_position_continues_with_the_next_batch(tmp_path_factory, n_records, rows, stop):
    path = write(tmp_path_factory.mktemp("d"), "pc.jsonl",
                 [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(n_records)])
    data = load_data(path)
    straight = Batches(data, rows, 6)
    expected = [straight.next() for _ in range(stop + 2)]
    first = Batches(data, rows, 6)
    for _ in range(stop):
        first.next()
    state = json.loads(json.dumps(first.state()))        # as a checkpoint's manifest stores it
    resumed = Batches(data, rows, 6)
    assert resumed.restore(state) is None
    for want in expected[stop:]:
        got = resumed.next()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_restore_notes_changed_data(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x" * 100)
    b = Batches(load_data(path), 2, 8)
    b.next()
    state = b.state()
    path.write_text("y" * 120)
    assert "bytes" in Batches(load_data(path), 2, 8).restore(state)


@settings(max_examples=15, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 4]), per=st.integers(1, 3), steps=st.integers(1, 4),
       kind=st.sampled_from(["txt", "jsonl"]))
def test_rank_slices_together_are_the_single_process_batch(tmp_path_factory, world, per, steps, kind):
    """Each rank's slice of a global batch is disjoint and, in rank order, the batch one process sees;
    the data position (what a checkpoint keeps) counts global batches whatever the world size."""
    d = tmp_path_factory.mktemp("d")
    if kind == "txt":
        path = d / "a.txt"
        path.write_text("".join(chr(97 + i % 26) for i in range(300)))
    else:
        path = write(d, "pc.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)])
    data, rows = load_data(path), world * per
    single = Batches(data, rows, 8)
    ranks = [Batches(data, rows, 8, rank=r, world=world) for r in range(world)]
    for _ in range(steps):
        want = single.next()
        got = [b.next() for b in ranks]
        assert all(g[0].shape == (per, 8) for g in got)
        assert torch.equal(torch.cat([g[0] for g in got]), want[0])
        assert torch.equal(torch.cat([g[1] for g in got]), want[1])
    assert {json.dumps(b.state()) for b in ranks} == {json.dumps(single.state())}


def test_rank_slices_need_an_even_split():
    assert shard_rows(6, 1, 3) == range(2, 4)
    with pytest.raises(ConfigError, match="--batch-tokens.*evenly over 4 ranks"):
        shard_rows(6, 0, 4)
    with pytest.raises(ConfigError, match="rank"):
        shard_rows(6, 3, 3)


def test_examples_cut_before_their_first_loss_token_are_skipped(tmp_path):
    """An example whose loss tokens all lie past --seq-len would make a batch with no target (loss nan)."""
    path = write(tmp_path, "pc.jsonl", [{"prompt": "a long prompt of many bytes ", "completion": "x"},
                                        {"prompt": "Q ", "completion": "yes"}])
    data = load_data(path, seq_len=8)
    assert data.size == 1 and data.skipped == 1
    for i in range(3):
        _, labels = Batches(data, 2, 8).data.batch(i, 2, 8)
        assert (labels[:, 1:] != IGNORE).any(dim=1).all()       # every row has a shifted target


def test_every_example_cut_before_its_loss_is_an_error_naming_seq_len(tmp_path):
    path = write(tmp_path, "pc.jsonl", [{"prompt": "a long prompt of many bytes ", "completion": "x"}])
    with pytest.raises(ConfigError, match="--seq-len"):
        load_data(path, seq_len=8)
    assert load_data(path).size == 1                  # without a length, nothing is cut
