"""The text audit's parts (fedlora.text_audit): canaries that read back as drawn, the audited folder, and the losses
its attacks rank by, on a tiny GPT-2 trained in process: exposure high for a canary trained on, about chance for one
never seen; membership AUC near 1 where few members were trained on many times, and 0.5 within its interval for a
model that never saw them."""

import json
import math

import numpy as np
import pytest
import torch

from fedlora.audit import auc_interval, exposure, roc_auc
from fedlora.config import load_config
from fedlora.models import build_backbone
from fedlora.text import TextSplits, load_tokenizer, text_splits, tokenizer_of
from fedlora.text_audit import (TextCanaries, draw_sequences, sequence_losses, text_loss, word_ids,
                                write_audit_text, write_reference_text)

TOKENIZER = load_tokenizer(tokenizer_of(load_config("bible")))  # the packaged tiny GPT-2's, trained on fortunes
EOS = TOKENIZER.eos_id


def test_canaries_read_back_as_drawn_and_land_whole_in_their_clients_stream():
    canaries = TextCanaries.draw(TOKENIZER, list(range(40)), length=8, candidates=50, repeats=3, seed=0)
    assert len(canaries.sequences) == 40 and len(canaries.candidates) == 50 and 10 < canaries.included.sum() < 30
    words = set(word_ids(TOKENIZER).tolist())
    assert all(set(s.tolist()) <= words for s in canaries.sequences + canaries.candidates)
    written = canaries.written(TOKENIZER)
    assert set(written) == {c for c, coin in zip(canaries.clients, canaries.included) if coin}
    client = next(iter(written))
    stream = TOKENIZER.encode(["In the beginning." + written[client]])[0]
    sequence = canaries.sequences[canaries.clients.index(client)].tolist()
    found = [i for i in range(len(stream)) if stream[i:i + len(sequence)] == sequence]
    assert len(found) == 3  # each repeat, as drawn
    again = TextCanaries.draw(TOKENIZER, list(range(40)), length=8, candidates=50, repeats=3, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(again.sequences, canaries.sequences))


def test_the_audited_folder_holds_the_canaries_and_keeps_the_auxiliary_split_from_every_client(tmp_path):
    splits = TextSplits(tuple((f"u{i}", f"unit {i}") for i in range(10)), (("t", "test text"),))
    root = write_audit_text(splits, tmp_path, clients=6, aux_units=3, written={2: "\n canary words"})
    read = text_splits(f"folder:{root}")
    expected = [f"unit {i}" for i in range(7)]
    expected[2] += "\n canary words"
    assert [t for _, t in read.train] == expected
    assert [t for _, t in read.test] == ["test text"]
    reference = text_splits(f"folder:{write_reference_text(splits, tmp_path / 'reference', aux_units=3)}")
    assert [t for _, t in reference.train] == ["unit 7", "unit 8", "unit 9"]
    with pytest.raises(ValueError, match="need 11"):
        write_audit_text(splits, tmp_path / "x", clients=8, aux_units=3, written={})
    with pytest.raises(ValueError):
        write_audit_text(splits, tmp_path / "y", clients=3, aux_units=0, written={})


def _tiny_lm(seed: int = 0):
    torch.manual_seed(seed)
    return build_backbone("gpt2-tiny", num_classes=0)


def _train(model, sequences, steps: int, lr: float = 3e-3):
    """Every parameter, Adam, on the sequences (each after the end-of-text token) again and again."""
    ids = torch.as_tensor(np.stack([np.concatenate([[EOS], s]) for s in sequences]))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def test_a_canary_trained_on_is_exposed_and_one_never_seen_is_at_chance():
    rng = np.random.default_rng(1)
    seen, unseen = draw_sequences(TOKENIZER, 4, 8, rng), draw_sequences(TOKENIZER, 60, 8, rng)
    candidates = draw_sequences(TOKENIZER, 255, 8, rng)
    model = _train(_tiny_lm(), seen, steps=60)
    null = sequence_losses(model, candidates, EOS)
    exposed = exposure(-sequence_losses(model, seen, EOS), -null)
    assert exposed.min() == pytest.approx(8.0)  # log2(256): above every candidate
    chance = exposure(-sequence_losses(model, unseen, EOS), -null)
    assert abs(chance.mean() - math.log2(math.e)) < 0.6  # a uniform rank's expected exposure, 1.44 bits


def test_membership_by_loss_difference_finds_members_trained_on_and_nothing_without_them():
    rng = np.random.default_rng(2)
    clients = [draw_sequences(TOKENIZER, 3, 16, rng) for _ in range(24)]  # each client: three short texts
    members, others = clients[:12], clients[12:]
    reference = _tiny_lm(seed=1)

    def scores(model, group):
        return np.array([text_loss(reference, c, 16, EOS) - text_loss(model, c, 16, EOS) for c in group])

    untouched = _tiny_lm(seed=3)
    lo, hi = auc_interval(scores(untouched, members), scores(untouched, others))
    assert lo <= 0.5 <= hi
    trained = _train(_tiny_lm(seed=3), [s for c in members for s in c], steps=20)
    member_scores, other_scores = scores(trained, members), scores(trained, others)
    assert roc_auc(member_scores, other_scores) > 0.95
    assert auc_interval(member_scores, other_scores)[0] > 0.8


WORDS = ("the lord said unto moses speak unto the children of israel and say unto them when any man of you bring an "
         "offering unto the lord ye shall bring your offering of the cattle even of the herd and of the flock").split()


def _text_config(tmp_path, **overrides):
    from fedlora.config import RunConfig

    rng = np.random.default_rng(0)
    for split, files in (("train", 40), ("test", 4)):
        for i in range(files):
            path = tmp_path / "text" / split / f"{i:03d}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(" ".join(rng.choice(WORDS, 80)))
    return RunConfig.from_mapping({"model": "gpt2-tiny", "dataset": f"folder:{tmp_path / 'text'}",
                                   "partitioner": "natural", "head": "frozen", "num-clients": 34,
                                   "clients-per-round": 12, "num-rounds": 2, "local-steps": 2, "batch-size": 4,
                                   "seq-len": 16, "strategy": "ffa-lora", **overrides})


def test_the_text_audit_refuses_a_run_without_an_auxiliary_split_in_one_line(tmp_path):
    from fedlora.strategies.text_audit import check_text_audit

    with pytest.raises(ValueError, match="--aux-units") as refused:
        check_text_audit(_text_config(tmp_path), canaries=20, aux_units=0)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="need 41"):  # 40 units of training text
        check_text_audit(_text_config(tmp_path), canaries=20, aux_units=7)
    with pytest.raises(ValueError, match="seeded sampler"):  # who took part would be unknown to the audit
        check_text_audit(_text_config(tmp_path, **{"noise-source": "os"}), canaries=20, aux_units=6)


def test_fedlora_audit_text_runs_both_federations_scores_every_client_and_canary_and_scores_them_again(tmp_path,
                                                                                                        capsys):
    from fedlora.cli import main
    from fedlora.config import AUDIT_PRESET, RunConfig
    from fedlora.strategies.text_audit import audit_text

    sets = ["--set", "model=gpt2-tiny", f"dataset={_text_config(tmp_path).dataset}", "partitioner=natural",
            "head=frozen", "num-clients=34", "clients-per-round=12", "num-rounds=2", "local-steps=2", "batch-size=4",
            "seq-len=16", "strategy=ffa-lora"]
    config = load_config(None, [f"{k}={v}" for k, v in AUDIT_PRESET.items()] + sets[1:])  # the command's
    assert main(["audit", "--text", *sets, "--out", str(tmp_path / "refused")]) == 2
    assert not (tmp_path / "refused").exists()
    assert capsys.readouterr().err.count("\n") == 1  # one line: the auxiliary split
    assert main(["audit", "--text", "--aux-units", "6", "--canaries", "20", *sets, "--out", str(tmp_path / "audit")]) == 0
    out = capsys.readouterr().out
    assert "membership" in out and "exposure" in out and "accountant epsilon inf" in out
    result = json.loads((tmp_path / "audit" / "audit.json").read_text())
    membership, canaries = result["membership"], result["canaries"]
    assert membership["members"] + membership["non_members"] == 34 - 20  # the canary clients are in neither
    assert 0 < membership["members"] and 0 <= membership["auc"] <= 1
    assert canaries["count"] == 20 and 0 < canaries["included"] < 20
    assert 0 <= canaries["exposure_included"] <= canaries["exposure_max"] == pytest.approx(math.log2(1001))
    assert result["accountant_epsilon"] is None and result["threat_model"] == "not private"
    assert len(list((tmp_path / "audit" / "text" / "train").iterdir())) == 34  # 40 units less the 6 auxiliary
    recent = membership["recent"]  # the members drawn in the last release (a tenth of 2, at least one)
    assert recent["from_release"] == 2 and 0 < recent["members"] <= membership["members"]
    scores = json.loads((tmp_path / "audit" / "scores.json").read_text())
    assert len(scores["clients"]) == 14 and len(scores["candidates"]) == 1000
    # scored again from the finished federations, nothing trained again: the same numbers
    said = []
    again = audit_text(config, canaries=20, aux_units=6, out_dir=tmp_path / "audit", echo=said.append)
    assert sum(line.startswith("finished in") for line in said) == 2 and not any("round" in line for line in said)
    assert json.loads(json.dumps([again["membership"], again["canaries"]])) == [membership, canaries]
    # a private audit of the same recipe uses the reference federation the first one finished; another recipe's
    # audit is refused before it runs, the reference left as it was
    said = []
    private = audit_text(RunConfig.from_mapping({**config.to_mapping(), "strategy": "gm-ffa-lora"}), canaries=20, aux_units=6,
                         out_dir=tmp_path / "private", candidates=100, reference_dir=tmp_path / "audit" / "reference",
                         echo=said.append)
    assert math.isfinite(private["accountant_epsilon"]) and private["threat_model"] != "not private"
    assert f"finished in {tmp_path / 'audit' / 'reference' / 'run'}" in said
    with pytest.raises(ValueError, match=r"another recipe \(local-steps = 2, this audit's 1\)"):
        audit_text(RunConfig.from_mapping({**config.to_mapping(), "local-steps": 1}), canaries=20, aux_units=6,
                   out_dir=tmp_path / "other", candidates=100, reference_dir=tmp_path / "audit" / "reference")
    assert not (tmp_path / "other").exists()


def test_a_federation_of_the_audit_stopped_midway_continues_from_its_checkpoint(tmp_path):
    from fedlora.strategies.text_audit import _federate

    class Stop(Exception):
        pass

    def stop_after_round_1(line):
        if line.startswith("round   1/2"):
            raise Stop

    values = {**_text_config(tmp_path).to_mapping(), "num-rounds": 2}
    with pytest.raises(Stop):
        _federate(values, tmp_path / "run", stop_after_round_1)
    said = []
    strategy = _federate(values, tmp_path / "run", said.append)
    assert strategy.rounds_done == 2 and [line[:11] for line in said if line.startswith("round")] == ["round   2/2"]
