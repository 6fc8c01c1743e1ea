"""Fail fast (issue #10): a device error poisons the CUDA context, so the stage fails its streams
with UNAVAILABLE, turns NOT_SERVING and exits non-zero for Kubernetes to restart it; a CUDA graph
that cannot be captured stops the start unless --eager-fallback asks to run that step eagerly.

The device error is injected into a real code2wav service (its engine's step raises the error
CUDA reports for an illegal address) served by the real run_server on a localhost port."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import free_port
from voxpipe.bench.inprocess import InProcessPipeline
from voxpipe.services.code2wav import server as code2wav_server
from voxpipe.services.runtime import cuda_graphs
from voxpipe.services.runtime.engine import is_device_fatal
from voxpipe.services.runtime.server import DeviceFailure, run_async, run_server
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def test_device_errors_are_told_from_request_errors():
    assert is_device_fatal(RuntimeError(ILLEGAL_ADDRESS))
    assert is_device_fatal(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"))
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None:
        assert is_device_fatal(accelerator_error("device-side assert triggered"))
    for not_fatal in (RuntimeError("shape mismatch"), ValueError(ILLEGAL_ADDRESS), KeyError("x")):
        assert not is_device_fatal(not_fatal)


def test_a_device_error_fails_the_streams_turns_not_serving_and_exits(tiny_model_dir):
    parser = argparse.ArgumentParser()
    code2wav_server.add_arguments(parser)
    port = free_port()
    args = parser.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--host", "127.0.0.1",
                              "--port", str(port), "--grace", "1"])
    servicer = code2wav_server.build(args)

    engine = servicer.engine

    def poisoned_step() -> None:
        """The device fails on the first step after the whole request arrived (its frames_end): a
        failure while the client still writes would end the call under that write, which grpc-Python
        may report to the writer as INTERNAL instead of the call's status."""
        if all(j.frames_end for j in engine.waiting + engine.running):
            raise RuntimeError(ILLEGAL_ADDRESS)

    servicer.engine.step = poisoned_step

    async def scenario() -> tuple[grpc.StatusCode, str, int, BaseException]:
        serving = asyncio.ensure_future(run_server(servicer, pb_grpc.add_Code2WavServicer_to_server,
                                                   "voxpipe.v1.Code2Wav", servicer.opts))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await channel.channel_ready()
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            call = pb_grpc.Code2WavStub(channel).Decode()
            await call.write(pb.Code2WavRequest(start=pb.Code2WavStart()))
            await call.write(pb.Code2WavRequest(frames=pb.CodecFrames(codes=to_proto(torch.zeros(2, 16, dtype=torch.int32)))))
            # a whole request (frames_end, then the half-close): a stream half-closed before frames_end
            # is a bad request that may be refused before the engine ever steps it
            await call.write(pb.Code2WavRequest(frames_end=pb.FramesEnd()))
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            statuses = set()
            deadline = asyncio.get_running_loop().time() + 60
            while not serving.done():     # NOT_SERVING while it stops, then no server at all
                assert asyncio.get_running_loop().time() < deadline, (err.value.code(), err.value.details())
                try:
                    statuses.add((await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status)
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.01)
        with pytest.raises(DeviceFailure) as exited:     # run_async turns it into a non-zero exit
            serving.result()
        assert health_pb2.HealthCheckResponse.SERVING not in statuses
        return err.value.code(), err.value.details(), str(exited.value), servicer.engine.fatal

    code, details, exit_code, fatal = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE and "device error" in details, (code, details)
    assert isinstance(exit_code, str) and "device error" in exit_code and ILLEGAL_ADDRESS in exit_code
    assert str(fatal) == ILLEGAL_ADDRESS


def test_a_graph_that_cannot_be_captured_stops_the_start_unless_eager_fallback(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)       # engines build their graph plans on the CPU

    class Uncapturable:
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    for module in ("thinker.runner", "talker.runner", "code2wav.runner"):     # where each stage captures
        monkeypatch.setattr(f"voxpipe.services.{module}.GraphedStep", Uncapturable)
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "2"]
    with pytest.raises(cuda_graphs.GraphCaptureError, match="CUDA graph capture failed.*--eager-fallback"):
        InProcessPipeline.from_argv(argv)
    pipe = InProcessPipeline.from_argv(argv + ["--eager-fallback"])
    try:
        thinker = pipe.thinker.engine.runner
        assert thinker.graphs is None and thinker.prefill_graphs is None
        talker, code2wav = pipe.talker.engine.runner, pipe.code2wav.engine.runner
        assert talker.step_graphs is None and talker.predictor_graphs is None
        assert code2wav.graphs is None and code2wav.first_graphs is None
    finally:
        pipe.close()


def test_a_stage_refuses_to_start_on_a_failed_capture_with_a_clear_message(tiny_model_dir):
    """The real CLI path: GraphCaptureError ends `voxpipe <stage>` with exit code 2 and the reason."""
    import subprocess
    import sys

    code = ("import sys; from voxpipe.services.runtime import cuda_graphs; cuda_graphs.EMULATE = True\n"
            "import voxpipe.services.code2wav.runner as e\n"
            "class U:\n    def __init__(self, *a, **k): raise RuntimeError('capture refused')\n"
            "e.GraphedStep = U\n"
            "from voxpipe.cli import main\n"
            f"sys.exit(main(['code2wav', '--model', {str(tiny_model_dir)!r}, '--device', 'cpu', '--port', '0']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "code2wav: code2wav one-frame step: CUDA graph capture failed" in proc.stderr
    assert "--eager-fallback" in proc.stderr and "ready on port" not in proc.stdout


def test_run_async_exits_non_zero_on_a_device_failure():
    async def failing() -> None:
        raise DeviceFailure("voxpipe.v1.Talker: device error, exiting for a restart: " + ILLEGAL_ADDRESS)

    with pytest.raises(SystemExit) as exited:
        run_async(failing())
    assert exited.value.code == "voxpipe.v1.Talker: device error, exiting for a restart: " + ILLEGAL_ADDRESS
