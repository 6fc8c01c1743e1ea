"""Rows on the wire: the thinker's rows reach the talker as the same bits (raw bytes in their dtype,
read as a view of the received bytes), and text rows sent as token ids give the talker the rows it
would have been sent (the same frames). The malformed ones are refused in tests/test_bad_inputs.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
from safetensors import safe_open

from voxpipe.bench import row_transfer
from voxpipe.cli import build_parser
from voxpipe.services.runtime.outputs import Finished, FramesOut
from voxpipe.services.talker import server as talker_server
from voxpipe.services.runtime.outputs import TalkerPromptOut
from voxpipe.services.runtime.server import talker_prompt_proto
from voxpipe.services.runtime.tensors import from_proto, to_proto, view_proto
from voxpipe.services.talker.server import _rows
from voxpipe.services.thinker.relay import audio_rows_request
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

HIDDEN = 64          # the tiny checkpoint's thinker hidden size (test_bad_inputs checks it)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def awkward_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with the values a conversion would change: -0.0, the smallest subnormal, the
    largest finite value, one ulp above 1."""
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    info = torch.finfo(dtype)
    x[0, :4] = torch.tensor([-0.0, info.smallest_normal / 4, 1e4, 1 + info.eps]).to(dtype)
    return x


def over_the_wire(msg: pb.TalkerRequest) -> pb.TalkerRequest:
    return pb.TalkerRequest.FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_reach_the_talker_as_the_same_bits(dtype):
    """AudioRows (the relay's builder) and TextRows rows, serialized and parsed, decode (the talker's
    `_rows`: a view, checked) to the sender's bits in the sender's dtype, from any `first`."""
    x = awkward_rows(9, dtype)
    for first in (0, 4):
        got = _rows(over_the_wire(audio_rows_request(x, first)).audio_rows.rows, HIDDEN, "audio_rows.rows", 9 - first)
        assert got.dtype == dtype and torch.equal(bits(got), bits(x[first:]))
    text = pb.TalkerRequest()
    to_proto(x[:2], text.rows.rows)
    got = _rows(over_the_wire(text).rows.rows, HIDDEN, "rows")
    assert got.dtype == dtype and torch.equal(bits(got), bits(x[:2]))


def test_every_wire_dtype_round_trips_and_a_view_is_its_own_memory():
    """Each dtype, 0 to n elements; from_proto's tensor owns its memory, and a view (of the bytes
    object a read of the field makes) is apart from the message: writing to it leaves the message
    as it was. 1-byte tensors (CPython shares those bytes objects) come copied."""
    for x in (torch.arange(-3, 4, dtype=torch.int64), torch.arange(7, dtype=torch.int32) - 3,
              torch.tensor([0, 1, 65535], dtype=torch.uint16), torch.tensor([True, False, True]),
              torch.tensor([True]), torch.zeros(0, HIDDEN), awkward_rows(2, torch.bfloat16)[:, ::2]):
        msg = to_proto(x)
        for decode in (from_proto, view_proto):
            got = decode(pb.Tensor.FromString(msg.SerializeToString()))
            assert got.dtype == x.dtype and got.shape == x.shape and torch.equal(bits(got), bits(x.contiguous()))
    msg = to_proto(torch.ones(4))
    view = view_proto(msg)
    view.zero_()
    assert torch.equal(from_proto(msg), torch.ones(4))
    one = view_proto(to_proto(torch.tensor([True])))
    one.zero_()
    assert bytes([1])[0] == 1          # CPython's shared 1-byte object is untouched


def test_a_prompt_built_in_place_equals_the_nested_build():
    """talker_prompt_proto fills its fields in place (no copy per nesting level): the same message
    as building it from finished Tensors."""
    g = torch.Generator().manual_seed(5)
    p = TalkerPromptOut(user_rows=None, user_mm_mask=torch.tensor([False, True]), user_token_ids=torch.tensor([7, 9]),
                        assistant_head=torch.randn(3, HIDDEN, generator=g), assistant_prefix=torch.zeros(0, HIDDEN),
                        tts_special=torch.randn(3, HIDDEN, generator=g), audio_rows=torch.randn(1, HIDDEN, generator=g),
                        audio_keys=(b"k" * 16,), audio_rows_follow=False)
    nested = pb.TalkerPrompt(user_mm_mask=to_proto(p.user_mm_mask), user_token_ids=to_proto(p.user_token_ids),
                             assistant_head=to_proto(p.assistant_head), assistant_prefix=to_proto(p.assistant_prefix),
                             tts_special=to_proto(p.tts_special), audio_rows=to_proto(p.audio_rows),
                             audio_keys=p.audio_keys)
    built = pb.ThinkerResponse()
    talker_prompt_proto(p, built.talker_prompt)
    assert built.talker_prompt == nested and not built.talker_prompt.HasField("user_rows")
    assert built.talker_prompt.HasField("assistant_prefix")


# ---------------------------------------------------------------- text rows as token ids


USERS = [268, 198, 199, 200, 389]       # a user turn's ids: <|user|> three words <|im_end|>


@pytest.fixture(scope="module")
def table(tiny_model_dir) -> torch.Tensor:
    """The thinker's input embedding table (what the thinker's TextDelta.embeddings are rows of)."""
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("thinker.model.embed_tokens.weight").float()


def _prompt(table: torch.Tensor) -> pb.TalkerPrompt:
    return talker_prompt_proto(TalkerPromptOut(
        user_rows=None, user_mm_mask=torch.zeros(len(USERS), dtype=torch.bool), user_token_ids=torch.tensor(USERS),
        assistant_head=table[[388, 272, 198]], assistant_prefix=table[:0], tts_special=table[[1, 2, 3]]))


def _rows_msg(table: torch.Tensor, ids: list[int], as_ids: bool, more: bool = True) -> pb.TalkerRequest:
    msg = pb.TalkerRequest(rows=pb.TextRows(token_ids=ids, more=more))
    if not as_ids:
        to_proto(table[ids], msg.rows.rows)
    return msg


@pytest.fixture(scope="module")
def talker(tiny_model_dir, loop):
    ns = build_parser().parse_args(["talker", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "4"])
    return talker_server.build(ns)


async def _made(talker, start: pb.TalkerStart):
    return talker.make_job(start)       # on the event loop, as the servicer makes it


def _speak(talker, table, replies: list[tuple[list[int], bool]]) -> list[torch.Tensor]:
    """The requests in one batch (each reply's ids, sent as ids or as rows): each one's codes."""
    engine, loop = talker.engine, asyncio.get_event_loop()
    jobs = []
    for i, (reply, as_ids) in enumerate(replies):
        start = pb.TalkerStart(request_id=f"r{i}", prompt=_prompt(table), max_frames=4, min_frames=4)
        job = loop.run_until_complete(_made(talker, start))
        engine.submit(job)
        engine.add_rows(job, talker._text_rows(_rows_msg(table, reply, as_ids).rows, HIDDEN))
        engine.end_text(job)
        jobs.append(job)
    while engine.has_work():
        engine.step()
    loop.run_until_complete(asyncio.sleep(0))
    out = []
    for job in jobs:
        items = []
        while (got := job.outbox.poll_timed()) is not None:
            items.append(got[0])
        assert isinstance(items[-1], Finished), items[-1]
        out.append(torch.cat([i.codes for i in items if isinstance(i, FramesOut)]))
    return out


def test_rows_as_ids_in_a_batch_with_rows_give_the_same_frames(talker, table):
    """A batch whose steps mix a request's rows sent as ids (looked up by the talker) with another's
    sent as rows: each request's frames equal its frames alone with rows."""
    a, b = [201, 202, 203], [210, 211, 212, 213]
    alone_a, = _speak(talker, table, [(a, False)])
    alone_b, = _speak(talker, table, [(b, False)])
    got_a, got_b = _speak(talker, table, [(a, True), (b, False)])
    assert alone_a.shape[0] == 3 and torch.equal(got_a, alone_a) and torch.equal(got_b, alone_b)


def _frames(channel, prompt: pb.TalkerPrompt, text: list[pb.TalkerRequest]) -> list[bytes]:
    start = pb.TalkerRequest(start=pb.TalkerStart(prompt=prompt, speaker="ethan", max_frames=12, min_frames=12))
    out = []
    for r in pb_grpc.TalkerStub(channel).Generate(iter([start, *text, pb.TalkerRequest(text_end=pb.TextEnd())]),
                                                  timeout=120):
        if r.WhichOneof("kind") == "frames":
            out.append(r.frames.codes.data)
    return out


def test_text_rows_as_token_ids_reach_a_real_talker(stack, table):
    """Over gRPC to the stack's talker: the reply's rows as the thinker's embeddings, as ids alone
    (TextRows.rows unset), and alternating: the same frames, greedy."""
    reply, prompt = [201, 202, 203, 204, 205], _prompt(table)
    with grpc.insecure_channel(stack.address("talker")) as channel:
        sent = _frames(channel, prompt, [_rows_msg(table, reply[:2], False), _rows_msg(table, reply[2:], False, False)])
        looked_up = _frames(channel, prompt, [_rows_msg(table, reply[:2], True), _rows_msg(table, reply[2:], True, False)])
        mixed = _frames(channel, prompt, [_rows_msg(table, reply[:1], True), _rows_msg(table, reply[1:3], False),
                                          _rows_msg(table, reply[3:], True, False)])
    assert len(sent) >= 2 and looked_up == sent and mixed == sent


def test_the_transfer_bench_runs_on_the_cpu(tiny_model_dir, tmp_path):
    """bench/row_transfer.py at the tiny checkpoint's width: both paths deliver the rows (the talker
    side's Held says how many it decoded) with the same bits, and the report has their times."""
    out = tmp_path / "rows.json"
    assert row_transfer.main(["--device", "cpu", "--config", str(tiny_model_dir), "--seconds", "2.5", "--iters", "3",
                              "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["rows"], report["hidden"], report["bits_equal"]) == (33, HIDDEN, True)
    assert all(report[p]["p50_ms"] > 0 for p in ("head", "now", "floor"))
    assert set(report["host_costs"]) == {"head", "now"}
