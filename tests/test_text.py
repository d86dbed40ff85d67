"""Text for language models: the readers (Debian's Bible, folders of .txt, JSON lines, hub-style datasets), the
tokenizer, packing into blocks, partitions by unit, and every bad input as one line before any work."""

import json
import os

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.text import (bible_unavailable_reason, load_tokenizer, parse_bible, partition_units,
                          text_splits, token_blocks, train_tokenizer, user_text)

BIBLE_LINES = ("Ge1:1 In the beginning God created the heaven and the earth.\n"
               "Ge1:2 And the earth was without form, and void.\n"
               "Ge2:1 Thus the heavens and the earth were finished.\n"
               "Re22:21 The grace of our Lord Jesus Christ be with you all. Amen.\n")


def test_the_bible_reader_makes_one_unit_per_chapter_from_what_bible_prints():
    assert parse_bible(BIBLE_LINES) == (
        ("Ge1", "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void."),
        ("Ge2", "Thus the heavens and the earth were finished."),
        ("Re22", "The grace of our Lord Jesus Christ be with you all. Amen."))


def test_the_real_bible_has_1189_chapters_one_in_ten_held_out():
    """The Debian package, when this machine has it (CI installs it in .ci/run: there a missing package fails)."""
    if reason := bible_unavailable_reason():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    splits = text_splits("bible-kjv")
    assert (len(splits.train), len(splits.test)) == (1071, 118)
    assert splits.train[0][0] == "Ge1" and splits.train[0][1].startswith("In the beginning God created")
    assert splits.test[0][0] == "Ge10" and not {n for n, _ in splits.train} & {n for n, _ in splits.test}


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def test_a_folder_of_text_files_is_one_unit_per_file_and_holds_out_a_tenth(tmp_path):
    for i in range(20):
        _write(tmp_path / "docs" / f"{i:02d}.txt", f"text number {i}")
    splits = user_text(f"folder:{tmp_path / 'docs'}")
    assert (len(splits.train), len(splits.test)) == (18, 2)
    assert sorted(n for n, _ in splits.train + splits.test) == [f"{i:02d}.txt" for i in range(20)]
    assert user_text(f"folder:{tmp_path / 'docs'}") == splits  # the same held-out files every time


def test_json_lines_group_rows_by_their_writer_and_train_test_folders_are_the_splits(tmp_path):
    rows = [{"user": u, "text": f"{u} says {i}"} for i in range(3) for u in ("ann", "bob", "cy")]
    _write(tmp_path / "d" / "train" / "posts.jsonl", "\n".join(map(json.dumps, rows)))
    _write(tmp_path / "d" / "test" / "held.jsonl", json.dumps({"user": "dee", "text": "dee says 0"}))
    splits = user_text(f"folder:{tmp_path / 'd'}")
    assert splits.train == (("posts.jsonl:ann", "ann says 0\nann says 1\nann says 2"),
                            ("posts.jsonl:bob", "bob says 0\nbob says 1\nbob says 2"),
                            ("posts.jsonl:cy", "cy says 0\ncy says 1\ncy says 2"))
    assert splits.test == (("held.jsonl:dee", "dee says 0"),)
    by_row = user_text(f"folder:{tmp_path / 'd'}", client_column="text")  # a named column wins
    assert len(by_row.train) == 9


def test_a_hub_style_dataset_reads_its_text_column_and_splits(tmp_path):
    """A dataset in the hub's layout (data files per split), read through datasets.load_dataset as hf:<id> is."""
    _write(tmp_path / "hub" / "train.jsonl", "\n".join(json.dumps({"content": f"row {i}", "n": i}) for i in range(5)))
    _write(tmp_path / "hub" / "test.jsonl", json.dumps({"content": "held", "n": 9}))
    splits = user_text(f"hf:{tmp_path / 'hub'}")
    assert [t for _, t in splits.train] == [f"row {i}" for i in range(5)] and splits.test == (("0", "held"),)


SKIP = 'or set unreadable = "skip" to leave such text out (counted where the run starts)'


@pytest.mark.parametrize(("files", "options", "message"), [
    ({"a.jsonl": '{"body": "x", "note": "y"}'}, {}, "has 2 text columns (body, note): set text-column."),
    ({"a.jsonl": '{"text": "x"}'}, {"text_column": "body"}, "has no column 'body' (text-column); its columns: text."),
    ({"a.txt": "", "b.txt": "x"}, {}, "'a.txt' is empty: every file is a unit of text, and a unit needs text."),
    ({"a.jsonl": "not json"}, {}, "'a.jsonl line 1' is not JSON: fix or remove it, " + SKIP + "."),
    ({"a.txt": "only one"}, {}, "has 1 unit of text: a test split needs another (add a file, or a test/ folder)."),
    ({"a.csv": "x"}, {}, "holds no text: expected .txt or .jsonl files."),
    ({"a.txt": "caf\xe9 au lait".encode("latin-1"), "b.txt": "x"}, {},  # read with replacement, U+FFFD trained on
     "'a.txt' is not UTF-8 (byte 0xe9 at offset 3): convert it (iconv -f <its encoding> -t utf-8) or remove it, "
     + SKIP + "."),
    ({"a.jsonl": '{"text": "na\xefve"}'.encode("latin-1")}, {},
     "'a.jsonl' is not UTF-8 (byte 0xef at offset 12): convert it (iconv -f <its encoding> -t utf-8) or remove it, "
     + SKIP + "."),
])
def test_bad_text_is_one_sentence(tmp_path, files, options, message):
    for name, text in files.items():
        _write(tmp_path / "d" / name, text)
    with pytest.raises(ValueError) as error:
        user_text(f"folder:{tmp_path / 'd'}", **options)
    assert str(error.value).endswith(message) and "\n" not in str(error.value)


def test_text_that_does_not_decode_is_left_out_and_named_when_asked(tmp_path):
    """unreadable = "skip": a Latin-1 file and a line that is not JSON are left out, each named with why; the rest
    reads as before, and a run's config counts them where it starts."""
    _write(tmp_path / "d" / "train" / "a.txt", "good")
    _write(tmp_path / "d" / "train" / "b.txt", "caf\xe9".encode("latin-1"))
    _write(tmp_path / "d" / "train" / "c.jsonl", '{"text": "kept"}\n{"text": cut')
    _write(tmp_path / "d" / "test" / "t.txt", "held")
    name = f"folder:{tmp_path / 'd'}"
    with pytest.raises(ValueError, match="'b.txt' is not UTF-8"):
        user_text(name)
    splits = user_text(name, unreadable="skip")
    assert [t for _, t in splits.train] == ["good", "kept"] and splits.test == (("t.txt", "held"),)
    assert splits.left_out == ("b.txt: not UTF-8 (byte 0xe9 at offset 3)", "c.jsonl line 2: not JSON")
    from fedlora.config import load_config

    config = load_config("bible", [f"dataset={name}", "unreadable=skip", "num-clients=1",
                                "clients-per-round=1"])
    assert config.task.left_out(config) == splits.left_out


def test_packing_joins_units_with_end_of_text_and_pads_only_the_last_block():
    ids, valid = token_blocks([np.array([1, 2, 3]), np.array([4, 5])], seq_len=4, eos_id=0)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]] and valid.tolist() == [[True] * 4, [True, True, True, False]]
    ids, valid = token_blocks([np.array([1, 2, 3, 4])], seq_len=4, eos_id=0)  # a last block of 1 token predicts none
    assert ids.tolist() == [[1, 2, 3, 4]] and valid.all()


def test_natural_partitions_deal_units_in_order_and_iid_ones_shuffle_them():
    assert [partition_units("natural", units=7, num_partitions=3, partition_id=p) for p in range(3)] == \
        [[0, 3, 6], [1, 4], [2, 5]]
    shares = [partition_units("iid", units=7, num_partitions=3, partition_id=p, seed=1) for p in range(3)]
    assert sorted(sum(shares, [])) == list(range(7)) and shares != [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="The data has 7 units .* for 8 clients: set num-clients <= 7."):
        partition_units("natural", units=7, num_partitions=8, partition_id=0)


def test_the_packaged_tokenizer_covers_every_byte_and_round_trips_text():
    from fedlora.text import tokenizer_of
    from fedlora.config import RunConfig

    config = RunConfig.from_mapping({"model": "gpt2-tiny-public", "dataset": "bible-kjv", "partitioner": "natural"})
    tokenizer = load_tokenizer(tokenizer_of(config))
    assert tokenizer.vocab_size == 4096 and tokenizer.eos_id == 0
    text = "And God said, Let there be light: naïve café ☃"
    (ids,) = tokenizer.encode([text])
    assert tokenizer.backend.decode(ids) == text


def test_a_trained_tokenizer_splits_its_own_text_into_fewer_tokens_than_bytes():
    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 50, vocab_size=300)
    assert len(tokenizer.encode("the quick brown fox").ids) < len("the quick brown fox") / 2


@pytest.mark.parametrize(("sets", "message"), [
    (["num-classes=10"], "num-classes is for classifiers: gpt2-tiny-public predicts the next token (set "
                         "num-classes = 0)."),
    (["seq-len=1"], "seq-len must be >= 2, got 1."),
    (["seq-len=300"], "seq-len (300) exceeds gpt2-tiny-public's 256 positions."),
    (["dataset=synthetic"], "gpt2-tiny-public is a language model: dataset must be text"),
    (["partitioner=dirichlet"], "Text is split over clients by its units (chapters, files, users): partitioner must "
                                "be natural or iid, got 'dirichlet'."),
    (["head=probe"], 'head = "probe" trains a classifier head first; gpt2-tiny-public has none'),
    (["model=vit-tiny", "dataset=synthetic"], 'partitioner = "natural" gives each client its writers\' images'),
])
def test_a_bad_text_config_is_one_line_and_exit_2_before_any_work(capsys, tmp_path, sets, message):
    args = ["run", "--config", "bible", "--out", str(tmp_path / "run")]
    assert main([*args, *(x for s in sets for x in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_tokenizer_that_does_not_fit_the_model_and_too_many_clients_are_one_line_each(capsys, tmp_path):
    from tokenizers import Tokenizer, models

    big = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(5000)}}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    for _ in range(20):
        _write(tmp_path / "docs" / f"{_}.txt", f"text {_}")
    base = ["run", "--config", "bible", "--set", f"dataset=folder:{tmp_path / 'docs'}", "--out", str(tmp_path / "r")]
    assert main([*base, "--set", f"tokenizer={tmp_path / 'big.json'}", "--set", "num-clients=10", "--set",
                 "clients-per-round=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has 5001 tokens, more than gpt2-tiny-public's 4096: its ids would fall outside the model's embedding" in err
    assert len(err.splitlines()) == 1
    assert main([*base, "--set", "num-clients=50", "--set", "clients-per-round=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("has 18 units of training text (chapters, files or users) for num-clients = 50: set "
                        "num-clients <= 18.") and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_text_splits_refuses_a_dataset_that_is_not_text():
    with pytest.raises(ValueError, match="'synthetic' is not text"):
        text_splits("synthetic")
    assert token_blocks([], 4, 0)[0].shape == (0, 4)  # no text, no block
