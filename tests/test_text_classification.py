"""Text classification as a task: tiny BERT, RoBERTa and DistilBERT take private rounds of both families, their head
travels in the message, clients trained together equal clients trained alone, and labelled text is read from class
subfolders, JSON lines and hub-style datasets, partitioned by label or by writer, with every bad input one line."""

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from peft import PeftModel

from fedlora.algorithms import LoRAMode
from fedlora.cli import main
from fedlora.clients.app import app as client_app
from fedlora.config import run_config_of
from fedlora.lora import build_lora_model, get_head
from fedlora.models import build_backbone
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.server_app import run_federation
from fedlora.tasks import task_named
from fedlora.text import example_tokens, labelled_text, load_tokenizer, partition_examples
from tests.helpers import DEVICES, assert_trained_together_as_alone

TC = task_named("text-classification")
TOPICS = {"sea": "ship water wave sail fish salt shore", "land": "field corn tree hill stone road farm",
          "sky": "cloud star sun moon bird wind rain"}


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _class_folders(root, per_class: int = 20):
    """A subfolder of .txt files per topic, each text a dozen words mostly of its topic."""
    rng = np.random.default_rng(0)
    for topic, words in TOPICS.items():
        for i in range(per_class):
            _write(root / topic / f"{i:02d}.txt", " ".join(rng.choice(words.split() + ["the", "and"], 12)))
    return root


def _run(tmp_path, **overrides):
    config = {"model": "bert-tiny", "dataset": f"folder:{_class_folders(tmp_path / 'text')}", "num-clients": 6,
              "clients-per-round": 3, "num-rounds": 1, "local-steps": 2, "batch-size": 4, "seq-len": 16,
              "sketch-dim": 16, "target-epsilon": 10.0, **{k.replace("_", "-"): v for k, v in overrides.items()},
              "out-dir": str(tmp_path / "run")}
    grid = InProcessGrid(client_app, config["num-clients"], config)
    strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                            run_config=config), echo=lambda line: None)
    return strategy, grid, config


@pytest.mark.parametrize("model", ["bert-tiny", "roberta-tiny", "distilbert-tiny"])
@pytest.mark.parametrize("strategy_name, placement", [("sgmm-ffa-lora", "server"), ("gm-flexlora", "client")])
def test_a_tiny_text_classifier_takes_a_private_round(tmp_path, model, strategy_name, placement):
    strategy, grid, config = _run(tmp_path, model=model, strategy=strategy_name, noise_placement=placement)
    assert len(grid.calls) == 3 and strategy.ledger.report().epsilon <= 10.0 + 1e-9
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 3 and rows[-1]["rejected"] == 0
    assert 0.0 <= rows[-1]["accuracy"] <= 1.0 and 0.0 < rows[-1]["loss"] < math.inf  # one noisy round: any loss
    assert (tmp_path / "run" / "accuracy.png").stat().st_size > 0
    # the head (DistilBERT's pre_classifier with it) travels dense in the message, beside LoRA's factors
    heads = {"bert-tiny": {"classifier.weight", "classifier.bias"},
             "roberta-tiny": {"classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
                              "classifier.out_proj.bias"},
             "distilbert-tiny": {"pre_classifier.weight", "pre_classifier.bias", "classifier.weight",
                                 "classifier.bias"}}[model]
    assert {n for n in strategy.state.message if "lora_" not in n} == heads
    # the PEFT adapter (head included) loads onto the same backbone built by transformers and scores the run's last
    # evaluation
    run_config = run_config_of(config)
    loaded = PeftModel.from_pretrained(build_backbone(model, num_classes=3), str(tmp_path / "run" / "adapter"))
    metrics = TC.evaluate(loaded, TC.test_data(run_config, "cpu"))
    assert metrics["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(rows[-1]["accuracy"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name, mode", [("bert-tiny", LoRAMode.FFA), ("roberta-tiny", LoRAMode.FFA),
                                              ("distilbert-tiny", LoRAMode.FLEX)])
def test_text_classifier_clients_trained_together_compute_what_each_computes_alone(model_name, mode, device):
    """Three clients in one pass per step, padding masked, head trained: each changes its adapter and head and
    loses what it does alone, within 1e-4."""
    model = build_lora_model(model_name, num_classes=3, rank=2, alpha=4.0, mode=mode, train_head=True).to(device)
    tokenizer = load_tokenizer(str(_packaged_tokenizer()))
    rng = np.random.default_rng(1)
    data = [example_tokens([" ".join(rng.choice(list(TOPICS), rng.integers(2, 20))) for _ in range(8)],
                           rng.integers(0, 3, 8).tolist(), tokenizer, 16, device=device) for _ in range(3)]
    assert not bool(data[0].valid.all())  # some examples are padded
    trainable = assert_trained_together_as_alone(model, data, TC)
    assert any("modules_to_save" in n for n in trainable)


def _packaged_tokenizer():
    from fedlora.models import PACKAGED_TOKENIZERS

    return PACKAGED_TOKENIZERS["fortunes-bpe-4096"].locate()


def test_padding_changes_no_prediction():
    """An example's scores are the same alone and beside a longer one (its padding masked out of attention)."""
    model = build_backbone("roberta-tiny", num_classes=3).eval()
    tokenizer = load_tokenizer(str(_packaged_tokenizer()))
    short = example_tokens(["sea ship"], [0], tokenizer, 6)
    both = example_tokens(["sea ship", "land field corn tree hill stone road"], [0, 1], tokenizer, 6)
    assert both.valid.sum(1).tolist()[1] == 6 and short.valid.sum() < 6  # the long one is cut to seq-len
    with torch.no_grad():
        alone = model(input_ids=short.ids, attention_mask=short.valid.long()).logits
        together = model(input_ids=both.ids, attention_mask=both.valid.long()).logits
    assert torch.allclose(alone[0], together[0], atol=1e-5)


def test_class_subfolders_are_one_example_a_file_with_a_stratified_tenth_held_out(tmp_path):
    text = labelled_text(f"folder:{_class_folders(tmp_path / 'd')}")
    assert text.classes == ("land", "sea", "sky") and not text.has_clients
    assert (len(text.train), len(text.test)) == (54, 6)
    assert sorted(label for _, label, _ in text.test) == [0, 0, 1, 1, 2, 2]  # two of each class's twenty
    assert labelled_text(f"folder:{tmp_path / 'd'}") == text  # the same held-out files every time


def test_json_lines_carry_labels_and_writers_and_a_natural_partition_gives_each_client_its_writers(tmp_path):
    rows = [{"author": a, "text": f"{a} writes {i}", "label": ["poem", "letter"][i % 2]}
            for i in range(4) for a in ("ann", "bob", "cy", "dee")]
    _write(tmp_path / "d" / "train" / "posts.jsonl", "\n".join(map(json.dumps, rows)))
    _write(tmp_path / "d" / "test" / "held.jsonl", json.dumps({"author": "eve", "text": "eve writes", "label": "poem"}))
    text = labelled_text(f"folder:{tmp_path / 'd'}")
    assert text.classes == ("letter", "poem") and text.has_clients and len(text.train) == 16
    assert text.test == (("eve writes", 1, "eve"),)
    parts = [partition_examples("natural", text, num_partitions=2, partition_id=p) for p in range(2)]
    assert [{text.train[i][2] for i in part} for part in parts] == [{"ann", "cy"}, {"bob", "dee"}]
    with pytest.raises(ValueError, match="test split has labels its train split lacks: eve"):  # a named column wins
        labelled_text(f"folder:{tmp_path / 'd'}", label_column="author", client_column="label")


def test_a_hub_style_dataset_reads_its_text_and_label_columns(tmp_path):
    """A dataset in the hub's layout (data files per split), read through datasets.load_dataset as hf:<id> is;
    whole-number labels are classes 0..K-1."""
    _write(tmp_path / "hub" / "train.jsonl", "\n".join(json.dumps({"sentence": f"row {i}", "label": i % 3})
                                                       for i in range(9)))
    _write(tmp_path / "hub" / "test.jsonl", json.dumps({"sentence": "held", "label": 2}))
    text = labelled_text(f"hf:{tmp_path / 'hub'}")
    assert text.classes == ("0", "1", "2") and [t for t, _, _ in text.train][:2] == ["row 0", "row 1"]
    assert text.test == (("held", 2, None),)
    # a ClassLabel's names are the classes, its indices the labels (parquet keeps the feature, as the hub's files do)
    import datasets

    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    (tmp_path / "sst").mkdir()
    for split, rows in (("train", [("bad", 0), ("good", 1), ("fine", 1)]), ("test", [("awful", 0)])):
        datasets.Dataset.from_dict({"sentence": [t for t, _ in rows], "label": [y for _, y in rows]},
                                   features=features).to_parquet(str(tmp_path / "sst" / f"{split}.parquet"))
    sst = labelled_text(f"hf:{tmp_path / 'sst'}")
    assert sst.classes == ("neg", "pos") and [y for _, y, _ in sst.train] == [0, 1, 1] and sst.test == (("awful", 0, None),)
    # an unlabelled test split (GLUE's: every label -1) gives way to the validation split
    _write(tmp_path / "glue" / "train.jsonl", (tmp_path / "hub" / "train.jsonl").read_text())
    _write(tmp_path / "glue" / "test.jsonl", json.dumps({"sentence": "unknown", "label": -1}))
    _write(tmp_path / "glue" / "validation.jsonl", json.dumps({"sentence": "checked", "label": 1}))
    assert labelled_text(f"hf:{tmp_path / 'glue'}").test == (("checked", 1, None),)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "pathological"])
def test_label_partitions_cover_every_example_once(tmp_path, kind):
    text = labelled_text(f"folder:{_class_folders(tmp_path / 'd')}")
    parts = [partition_examples(kind, text, num_partitions=6, partition_id=p, alpha=0.5) for p in range(6)]
    every = sorted(i for part in parts for i in part)
    assert len(every) == len(set(every)) and set(every) <= set(range(len(text.train))) and all(parts)
    if kind == "pathological":  # two classes a client
        assert all(len({text.train[i][1] for i in part}) <= 2 for part in parts)
    else:
        assert len(every) == len(text.train)


@pytest.mark.parametrize(("files", "options", "message"), [
    ({"a/x.txt": "sea", "a/y.txt": "sky"}, {}, "has 1 class (a); a classifier needs at least 2."),
    ({"a/x.txt": "sea", "b/y.txt": ""}, {}, "'b/y.txt' is empty: every file is an example, and an example needs text."),
    ({"a/x.txt": "sea", "b/y.md": "land"}, {}, "class folder 'b' holds no .txt files."),
    ({"r.jsonl": '{"text": "x"}'}, {}, "has no label columns (text): set label-column."),
    ({"r.jsonl": '{"text": "x", "label": "a"}'}, {"label_column": "topic"},
     "has no column 'topic' (label-column); its columns: text, label."),
    ({"r.jsonl": '{"text": "x", "label": "a"}\n{"text": "", "label": "b"}'}, {}, "row 2 has no text in its 'text' field."),
    ({"r.jsonl": '{"text": "x", "label": "a"}\n{"text": "y", "label": 1.5}'}, {},
     "row 2 has no label in its 'label' field (a class name or a whole number)."),
    ({"r.jsonl": '{"text": "x", "label": "a"}\n{"text": "y", "label": 1}'}, {},
     "labels mix names and numbers (1, a): use one kind."),
    ({"train/a/x.txt": "s", "train/b/y.txt": "l", "test/c/z.txt": "k"}, {},
     "test split has labels its train split lacks: c."),
    ({"a/x.txt": "sea", "b/y.txt": "land"}, {}, "has no test examples (each class has one example, or its test split "
                                                "is empty): add examples, or a test/ folder."),
    ({"a/x.txt": "sea", "b/y.txt": "land"}, {"text_column": "body"}, "class subfolders name the labels (one example a "
     "file): text-column, label-column and client-column name JSON-lines fields."),
    ({"a.csv": "x"}, {}, "holds no labelled text: expected a subfolder of .txt files per class, or .jsonl files with "
                         "a text and a label field."),
])
def test_bad_labelled_text_is_one_sentence(tmp_path, files, options, message):
    for name, text in files.items():
        _write(tmp_path / "d" / name, text)
    with pytest.raises(ValueError) as error:
        labelled_text(f"folder:{tmp_path / 'd'}", **options)
    assert str(error.value).endswith(message) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize(("sets", "message"), [
    (["dataset=synthetic"], "bert-tiny classifies text: dataset must be labelled text"),
    (["seq-len=1"], "seq-len must be >= 2, got 1."),
    (["seq-len=300"], "seq-len (300) exceeds bert-tiny's 256 positions."),
    (["model=roberta-tiny", "seq-len=257"], "seq-len (257) exceeds roberta-tiny's 256 positions."),
    (["partitioner=natural"], 'partitioner = "natural" needs a client column'),
    (["num-classes=5"], "has 3 classes, but num-classes = 5: set num-classes = 3, or 0 (the data's)."),
    (["num-clients=100"], "has 54 training examples for num-clients = 100: set num-clients <= 54."),
    (["model=gpt2-tiny", "num-classes=3"], "num-classes is for classifiers: gpt2-tiny predicts the next token"),
])
def test_a_bad_text_classification_config_is_one_line_and_exit_2_before_any_work(capsys, tmp_path, sets, message):
    data = _class_folders(tmp_path / "d")
    args = ["run", "--set", "model=bert-tiny", "--set", f"dataset=folder:{data}", "--set", "num-clients=6",
            "--set", "clients-per-round=3", "--out", str(tmp_path / "run")]
    assert main([*args, *(x for s in sets for x in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists(), err


def test_describe_names_a_text_classifier_and_its_head(capsys):
    assert main(["describe", "--model", "distilbert-tiny", "--num-classes", "4", "--sketch-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "distilbert-tiny: distilbert 'distilbert-tiny', text classifier, random init" in out
    model = build_lora_model("distilbert-tiny", num_classes=4, rank=4, alpha=8.0, train_head=True)
    head = sum(t.numel() for t in get_head(model).values())
    assert head == 128 * 128 + 128 + 4 * 128 + 4 and f"classifier head: {head:,} values" in out


def _checkpoint(folder, kind: str):
    """A transformers checkpoint as save_pretrained writes it (what the hub serves): a tiny Qwen2 causal LM or a
    BERT encoder, with the packaged tokenizer as a fast tokenizer beside it."""
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    shapes = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128)
    model = Qwen2ForCausalLM(Qwen2Config(**shapes, num_key_value_heads=2)) if kind == "qwen2" else \
        BertModel(BertConfig(**shapes))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(_packaged_tokenizer()), eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen2", "bert"])
def test_a_checkpoint_by_hf_id_takes_a_private_round_of_its_task(tmp_path, kind):
    """model = "hf:<id>" reads the checkpoint's config for its family and task (a Qwen2 causal LM: LLaMA's module
    names; a BERT encoder: a sequence classifier with a fresh head), loads its weights and its own tokenizer through
    transformers (a folder here, the hub's id elsewhere: the same from_pretrained)."""
    from fedlora.models import model_spec

    name = f"hf:{_checkpoint(tmp_path / kind, kind)}"
    spec = model_spec(name)
    assert (spec.family, spec.task) == ({"qwen2": "llama", "bert": "bert"}[kind],
                                        {"qwen2": "causal-lm", "bert": "text-classification"}[kind])
    if kind == "qwen2":
        from tests.test_causal_lm import _text_folder

        extra = {"dataset": f"folder:{_text_folder(tmp_path / 'lm')}", "partitioner": "natural", "head": "frozen",
                 "num_clients": 5}
    else:
        extra = {}
    strategy, grid, config = _run(tmp_path, model=name, **extra)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 3 and math.isfinite(rows[-1]["loss"]) and strategy.ledger.rounds == 1
    layers = {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in strategy.state.message if "lora_" in n}
    assert layers == ({"q_proj", "v_proj"} if kind == "qwen2" else {"query", "value"})


@pytest.mark.parametrize(("model", "message"), [
    ("hf:", 'model = "hf:" names no checkpoint: give hf:<hub id> or hf:<folder>.'),
    ("hf:{tmp}/empty", "its config could not be read"),
    ("hf:{tmp}/vit", "is a 'vit' model; fedlora adapts bert, distilbert, gemma"),
    ("bert-tinyy", "model must be one of"),
])
def test_a_bad_hf_model_is_one_line_and_exit_2(capsys, tmp_path, model, message):
    from transformers import ViTConfig

    (tmp_path / "empty").mkdir()
    ViTConfig().save_pretrained(tmp_path / "vit")
    assert main(["run", "--set", f"model={model.format(tmp=tmp_path)}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists(), err


def test_a_node_reads_its_own_labelled_text_by_the_runs_class_names(tmp_path):
    """A deployed SuperNode's data-dir: a subfolder of .txt files per class, each class one of the run's (the labels
    are the run's indices, whatever classes the node lacks); a class the run does not have is one line."""
    from fedlora.config import RunConfig
    from fedlora.node import NodeSettings

    config = RunConfig.from_mapping({"model": "bert-tiny", "dataset": f"folder:{_class_folders(tmp_path / 'd')}",
                                     "num-clients": 6, "clients-per-round": 3, "seq-len": 16})
    _write(tmp_path / "own" / "sky" / "a.txt", "star moon")
    _write(tmp_path / "own" / "sky" / "b.txt", "cloud rain wind")
    _write(tmp_path / "own" / "land" / "c.txt", "farm road")
    own = TC.train_data(config, NodeSettings(partition_id=0, num_partitions=1, data_dir=str(tmp_path / "own")), "cpu")
    assert sorted(own.labels.tolist()) == [0, 2, 2] and len(own) == 3  # land is class 0, sky class 2
    _write(tmp_path / "own" / "moon" / "d.txt", "crater")
    with pytest.raises(ValueError, match="class folder 'moon' is not one of the run's classes"):
        TC.train_data(config, NodeSettings(partition_id=0, num_partitions=1, data_dir=str(tmp_path / "own")), "cpu")
    # a node that holds only its own text names its classes 0..K-1, as for images, with num-classes set
    elsewhere = RunConfig.from_mapping({**config.to_mapping(), "dataset": f"folder:{tmp_path / 'not-here'}",
                                        "num-classes": 3})
    _write(tmp_path / "indexed" / "2" / "a.txt", "star moon")
    _write(tmp_path / "indexed" / "0" / "b.txt", "farm road")
    own = TC.train_data(elsewhere, NodeSettings(partition_id=0, num_partitions=1, data_dir=str(tmp_path / "indexed")),
                        "cpu")
    assert sorted(own.labels.tolist()) == [0, 2]
    with pytest.raises(ValueError, match="cannot read the run's dataset .* set num-classes"):
        TC.train_data(RunConfig.from_mapping({**elsewhere.to_mapping(), "num-classes": 0}),
                      NodeSettings(partition_id=0, num_partitions=1, data_dir=str(tmp_path / "indexed")), "cpu")


def test_a_fine_tuned_checkpoint_keeps_its_head_of_the_runs_size_and_gets_a_fresh_one_of_another(tmp_path):
    """A classifier checkpoint by hf: whose head has as many classes as the run goes on from it; one of another size
    gets a fresh head (no traceback)."""
    import transformers

    saved = build_backbone("bert-tiny", num_classes=2, seed=7)
    saved.save_pretrained(tmp_path / "two")
    same = build_backbone(f"hf:{tmp_path / 'two'}", num_classes=2)
    other = build_backbone(f"hf:{tmp_path / 'two'}", num_classes=3)
    assert torch.equal(same.classifier.weight, saved.classifier.weight)
    assert other.classifier.weight.shape == (3, 128) and isinstance(other, transformers.BertForSequenceClassification)
    assert torch.equal(other.bert.embeddings.word_embeddings.weight, saved.bert.embeddings.word_embeddings.weight)


def test_a_hub_familys_random_twin_pads_with_its_tokenizers_id():
    """roberta-base-random is padded as RoBERTa's tokenizer pads (<pad> = 1, <s> = 0), the tiny ones with the packaged
    tokenizer's end-of-text (0); RoBERTa's 514 positions leave 512 for tokens."""
    from fedlora.tasks.text_classification import max_positions

    with torch.device("meta"):
        assert build_backbone("roberta-base-random", num_classes=2).config.pad_token_id == 1
    assert build_backbone("roberta-tiny", num_classes=2).config.pad_token_id == 0
    assert max_positions("roberta-base-random") == 512 and max_positions("roberta-tiny") == 256
