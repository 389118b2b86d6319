"""Tokenized training text: every input kind and error, EOS between documents, windows."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from rewrite.run.byte_data import TrainConfigError, default_data_path
from rewrite.run.text_data import TokenWindows, load_text_windows, read_documents, tokenize_documents


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- read_documents -------------------------------------------------------------------


def test_txt_is_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("line one\nline two\n")
    assert read_documents(tmp_path / "a.txt") == ["line one\nline two\n"]
    assert read_documents(str(default_data_path()))[0] == default_data_path().read_text()


def test_jsonl_is_one_document_per_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "first", "id": 1}, {"text": ""}, {"text": "sec\u2028ond"}])
    path.write_text(path.read_text() + "\n")  # a blank line is no document
    assert read_documents(path) == ["first", "sec\u2028ond"]  # the empty one skipped


def test_directory_of_mixed_files_in_path_order(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.txt").write_text("A/B")
    (tmp_path / "a-b.txt").write_text("A-B")
    write_jsonl(tmp_path / "a.jsonl", [{"text": "J1"}, {"text": "J2"}])
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notes.md").write_text("ignored")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "copy.txt").write_text("ignored")
    # by path components: ("a", "b.txt") < ("a-b.txt",) < ("a.jsonl",), though "a-b.txt" < "a/b.txt"
    assert read_documents(tmp_path) == ["A/B", "A-B", "J1", "J2"]


@pytest.mark.parametrize("as_dict", [False, True])
def test_saved_dataset(tmp_path, as_dict):
    import datasets

    train = datasets.Dataset.from_dict({"text": ["one", "", "two"], "n": [1, 2, 3]})
    saved = datasets.DatasetDict(train=train, test=datasets.Dataset.from_dict({"text": ["x"]})) if as_dict else train
    saved.save_to_disk(str(tmp_path / "ds"))
    assert read_documents(tmp_path / "ds") == ["one", "two"]


def test_saved_dataset_dict_with_one_split_uses_it(tmp_path):
    import datasets

    datasets.DatasetDict(validation=datasets.Dataset.from_dict({"text": ["v"]})).save_to_disk(str(tmp_path / "ds"))
    assert read_documents(tmp_path / "ds") == ["v"]


def test_saved_dataset_errors(tmp_path):
    import datasets

    one = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict(a=one, b=one).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(TrainConfigError, match=r"splits \['a', 'b'\] and no 'train' split"):
        read_documents(tmp_path / "splits")
    datasets.Dataset.from_dict({"body": ["a"], "id": [1]}).save_to_disk(str(tmp_path / "cols"))
    with pytest.raises(TrainConfigError, match=r"columns \['body', 'id'\] and no 'text' column.*rename_column"):
        read_documents(tmp_path / "cols")
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(tmp_path / "ints"))
    with pytest.raises(TrainConfigError, match="column 'text' is .*int64.*not strings"):
        read_documents(tmp_path / "ints")


def test_saved_dataset_without_datasets_installed(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(TrainConfigError, match=r"datasets` is not installed; pip install \"rewrite\[data\]\""):
        read_documents(tmp_path / "ds")


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(TrainConfigError, match=r"bad.jsonl:3: not JSON"):
        read_documents(bad)
    write_jsonl(bad, [{"text": "ok"}, {"body": "no text"}])
    with pytest.raises(TrainConfigError, match=r"bad.jsonl:2: needs a string field \"text\", found keys \['body'\]"):
        read_documents(bad)
    write_jsonl(bad, [{"text": 5}])
    with pytest.raises(TrainConfigError, match=r"bad.jsonl:1: needs a string field"):
        read_documents(bad)
    write_jsonl(bad, [["text"]])
    with pytest.raises(TrainConfigError, match=r"bad.jsonl:1: .*found a list"):
        read_documents(bad)


def test_path_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainConfigError, match=r"holds no .txt or .jsonl files \(found: nothing\)"):
        read_documents(tmp_path / "empty")
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(TrainConfigError, match=r"holds no .txt or .jsonl files \(found: notes.md\)"):
        read_documents(tmp_path / "empty")
    with pytest.raises(TrainConfigError, match=r"cannot read a .md file; pass a .txt file"):
        read_documents(tmp_path / "empty" / "notes.md")
    with pytest.raises(TrainConfigError, match="does not exist"):
        read_documents(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(TrainConfigError, match="holds no text"):
        read_documents(tmp_path / "blank.txt")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(TrainConfigError, match="latin1.txt: byte 3 is not UTF-8"):
        read_documents(tmp_path / "latin1.txt")


# -- tokenize_documents ---------------------------------------------------------------


def test_eos_after_every_document_and_no_other_specials(tokenizer):
    stream = tokenize_documents(["Alice was", "tired."], tokenizer)
    first, second = (tokenizer.encode(t, add_special_tokens=False) for t in ["Alice was", "tired."])
    eos = tokenizer.eos_token_id
    assert stream.dtype == torch.int64 and stream.dim() == 1
    assert stream.tolist() == [*first, eos, *second, eos]
    assert tokenizer.bos_token_id not in stream.tolist()


def test_tokenizer_without_eos_is_an_error(checkpoint):
    from transformers import AutoTokenizer

    no_eos = AutoTokenizer.from_pretrained(checkpoint)
    no_eos.eos_token = None
    with pytest.raises(TrainConfigError, match="has no EOS token"):
        tokenize_documents(["text"], no_eos)


def test_alice_tokenizes_fast(tokenizer):
    documents = read_documents(default_data_path())
    start = time.process_time()
    stream = tokenize_documents(documents, tokenizer)
    assert time.process_time() - start < 1.5
    assert tokenizer.decode(stream[:-1]) == documents[0]


# -- TokenWindows ---------------------------------------------------------------------


def test_windows_share_one_token_and_drop_the_tail():
    windows = TokenWindows(torch.arange(25), seq_len=10, seed=0)  # windows 0..10, 10..20; 21..24 dropped
    assert len(windows) == 2
    inputs, targets = windows.take(0, 2)
    assert inputs.shape == targets.shape == (2, 10) and inputs.dtype == torch.int64
    assert sorted(inputs[:, 0].tolist()) == [0, 10]
    assert torch.equal(targets, inputs + 1)  # the target is the next token, across window boundaries too
    assert len(TokenWindows(torch.arange(9), seq_len=8, seed=0)) == 1  # exactly one window


def test_targets_are_inputs_shifted_on_real_text(tokenizer):
    stream = tokenize_documents(["Alice was beginning to get very tired.", "Of sitting by her sister."], tokenizer)
    windows = TokenWindows(stream, seq_len=7, seed=3)
    inputs, targets = windows.take(0, len(windows))
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    for position, index in enumerate(windows.permutation(0).tolist()):  # epoch 0's order
        assert torch.equal(inputs[position], stream[index * 7 : index * 7 + 7])
        assert torch.equal(targets[position], stream[index * 7 + 1 : index * 7 + 8])


def test_every_window_once_per_epoch_and_epochs_differ():
    windows = TokenWindows(torch.arange(201), seq_len=4, seed=7)
    n = len(windows)
    assert n == 50
    inputs, _ = windows.take(0, 3 * n)
    orders = (inputs[:, 0] // 4).view(3, n)  # window index of each position, per epoch
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])


def test_take_across_an_epoch_boundary_equals_two_takes():
    windows = TokenWindows(torch.arange(101), seq_len=10, seed=1)
    n = len(windows)
    whole = windows.take(n - 3, 6)
    fresh = TokenWindows(torch.arange(101), seq_len=10, seed=1)
    parts = [fresh.take(n - 3, 3), fresh.take(n, 3)]
    for got, a, b in zip(whole, *parts):
        assert torch.equal(got, torch.cat([a, b]))
    epoch1 = TokenWindows(torch.arange(101), seq_len=10, seed=1).permutation(1)
    assert (whole[0][3:, 0] // 10).tolist() == epoch1[:3].tolist()
    assert windows.take(5, 0)[0].shape == (0, 10)


def test_same_cursor_same_batch_whatever_happened_before():
    stream = torch.randint(0, 500, (1000,), generator=torch.Generator().manual_seed(0))
    first = TokenWindows(stream, seq_len=16, seed=5)
    torch.manual_seed(1)
    first.take(0, 200)  # walks through several epochs, filling and evicting the cache
    second = TokenWindows(stream.clone(), seq_len=16, seed=5)
    torch.manual_seed(2)  # the global RNG plays no part
    for cursor in [0, 61, 62, 150, 1000]:
        for a, b in zip(first.take(cursor, 5), second.take(cursor, 5)):
            assert torch.equal(a, b), cursor
    other = TokenWindows(stream, seq_len=16, seed=6)
    assert not torch.equal(other.take(0, 20)[0], first.take(0, 20)[0])


def test_too_few_tokens_is_an_error():
    with pytest.raises(TrainConfigError, match=r"5 tokens, too few .* seq_len \+ 1 = 9 tokens; use seq_len <= 4"):
        TokenWindows(torch.arange(5), seq_len=8, seed=0)
    with pytest.raises(TrainConfigError, match="1 tokens.*pass more text"):
        TokenWindows(torch.arange(1), seq_len=8, seed=0)
    with pytest.raises(ValueError, match="both must be >= 0"):
        TokenWindows(torch.arange(50), seq_len=8, seed=0).take(-1, 2)


# -- load_text_windows ----------------------------------------------------------------


def test_load_text_windows_on_alice(checkpoint, tokenizer):
    windows = load_text_windows(default_data_path(), checkpoint, seq_len=64, seed=0)
    inputs, targets = windows.take(0, 4)
    assert inputs.shape == targets.shape == (4, 64)
    assert int(inputs.max()) < len(tokenizer)
    assert tokenizer.decode(inputs[0]) in default_data_path().read_text()
    assert windows.stream[-1].item() == tokenizer.eos_token_id


def test_load_text_windows_needs_a_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TrainConfigError, match=r"holds no tokenizer: it needs tokenizer.json.*`rewrite init-model"):
        load_text_windows(default_data_path(), tmp_path, seq_len=8, seed=0)
