"""What a run reports while it runs: TensorBoard event files equal to metrics.jsonl, and the replies of the round
under way (collected as they arrive, shown in place on a terminal or as plain lines)."""

import json
import math

from flwr.app import Context, Message, RecordDict
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedlora.clients.app import app as client_app
from fedlora.launch import RoundProgress
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.replies import gather
from fedlora.strategies.server_app import run_federation
from fedlora.tracking import SCALARS, TensorBoardTracker, epsilon_tag, read_progress, write_progress
from tests.helpers import PAPER_FORM

SMALL = {**PAPER_FORM, "num-clients": 4, "clients-per-round": 2, "num-rounds": 2, "local-steps": 1, "batch-size": 8,
         "train-examples": 120, "test-examples": 40, "num-classes": 10, "sketch-dim": 16}


def _run(out, **overrides):
    config = {**SMALL, **overrides, "out-dir": str(out)}
    run_federation(InProcessGrid(client_app, config["num-clients"], config),
                   Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                   echo=lambda line: None)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_writes_event_files_whose_scalars_equal_its_metrics(tmp_path):
    rows = _run(tmp_path)
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for key, tag in SCALARS.items():
        expected = [(r["round"], r[key]) for r in rows if r[key] is not None and math.isfinite(r[key])]
        assert [(step, round(value, 4)) for step, value in scalars.get(tag, [])] == \
            [(step, round(float(value), 4)) for step, value in expected], tag
    for observer in (o for o, value in rows[-1]["epsilon_by_observer"].items() if math.isfinite(value)):
        assert [round(v, 4) for _, v in scalars[epsilon_tag(observer)]] == \
            [round(r["epsilon_by_observer"][observer], 4) for r in rows]
    assert rows[-1]["epsilon"] < math.inf and any("against" in tag for tag in scalars)
    threat_models = events.Tensors("privacy/threat model/text_summary")  # the label, every round
    assert rows[-1]["threat_model"] in threat_models[-1].tensor_proto.string_val[0].decode()


def test_tracker_none_writes_no_event_files_and_the_last_round_reports_every_reply(tmp_path):
    _run(tmp_path, tracker="none")
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert read_progress(tmp_path) | {"time": 0} == {"round": 2, "arrived": 2, "sent": 2, "time": 0}


class TrickleGrid:
    """A grid whose replies arrive one per pull (as from a SuperLink); node 9 never answers, and a message to
    node 0 cannot be pushed (no id, as Flower's HttpGrid returns)."""

    pull_interval = 0.01

    def __init__(self):
        self.pending = []

    def push_messages(self, messages):
        self.pending = [(f"m{i}", m.metadata.dst_node_id) for i, m in enumerate(messages)]
        for (message_id, node), message in zip(self.pending, messages):  # as Flower's grids name what they push
            message.metadata.__dict__["_message_id"] = message_id if node else ""
        return [message_id if node else None for message_id, node in self.pending]

    def pull_messages(self, message_ids):
        answerable = [(i, node) for i, node in self.pending if i in message_ids and node != 9]
        if not answerable:
            return []
        message_id, node = answerable[0]
        self.pending.remove((message_id, node))
        reply = Message(RecordDict(), dst_node_id=node, message_type="train")
        reply.metadata.__dict__["_reply_to_message_id"] = message_id
        return [reply]


def _messages(*nodes):
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


def test_gather_reports_each_reply_as_it_arrives_and_reaches_the_sent_count():
    seen = []
    replies = gather(TrickleGrid(), _messages(1, 2, 3), timeout=10, progress=lambda *counts: seen.append(counts))
    assert len(replies) == 3 and seen == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_gather_stops_at_the_timeout_with_the_replies_so_far():
    seen = []
    replies = gather(TrickleGrid(), _messages(1, 9), timeout=0.5, progress=lambda *counts: seen.append(counts))
    assert len(replies) == 1 and seen[-1] == (1, 2)


def test_gather_does_not_wait_for_a_message_that_was_never_pushed():
    seen = []
    replies = gather(TrickleGrid(), _messages(1, 0, 2), timeout=30, progress=lambda *counts: seen.append(counts))
    assert len(replies) == 2 and seen == [(0, 2), (1, 2), (2, 2)]  # the unpushed message: neither sent nor awaited


def test_round_progress_is_in_place_on_a_terminal_and_plain_lines_elsewhere(tmp_path, capsys):
    write_progress(tmp_path, 3, 17, 50)
    live = RoundProgress(tmp_path, 10, print, live=True)
    live.show(rounds_done=2)
    live.clear()
    assert capsys.readouterr().out == "\r\033[Kround   3/10  17 of 50 replies\r\033[K"
    lines = []
    plain = RoundProgress(tmp_path, 10, lines.append, live=False)
    plain.show(rounds_done=2)
    assert lines == []  # a round's first seconds print nothing: short rounds stay one line each
    plain.printed -= RoundProgress.PLAIN_EVERY
    plain.show(rounds_done=2)
    plain.show(rounds_done=3)  # the round's line is out: its progress is stale
    assert lines == ["  round   3/10  17 of 50 replies so far"]


def _row(round_, accuracy):
    return {"round": round_, "accuracy": accuracy, "epsilon_by_observer": {}, "threat_model": "known-sketch"}


def test_a_resumed_run_replaces_what_its_interrupted_self_wrote_after_the_checkpoint(tmp_path):
    """Killed after logging round 2 but before its checkpoint (which holds round 1): the resumed run's round 2
    replaces the lost one, so each round has one point, as in metrics.jsonl."""
    first = TensorBoardTracker(tmp_path)
    first.log(_row(1, 0.5))
    first.log(_row(2, 0.6))
    first.close()
    resumed = TensorBoardTracker(tmp_path, rounds_kept=1)
    resumed.log(_row(2, 0.7))
    resumed.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("test/accuracy")] == [(1, 0.5), (2, 0.7)]
