"""TLS everywhere, on real processes: the three stages serving mutual TLS and calling each other
with client certificates, the gateway calling them with its own client certificate and serving
HTTPS, WSS and TLS on Converse. Certificates come from a throwaway CA made here (plus a second,
foreign CA). One chain of processes for the whole module."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import STAGES, GatewayProcess, free_port, install_node_package
from voxpipe.client import AudioEvent, DoneEvent, PipelineClient, SpeechRequest, TextEvent
from voxpipe.services.runtime.balancer import StageBalancer
from voxpipe.services.runtime.tls import ClientTLS, ServerTLS, TLSConfigError
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import gateway_pb2_grpc as gw_grpc
from voxpipe.v1 import stages_pb2 as pb

HEALTH = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}


# ----------------------------------------------------------------------------- certificates

def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca, cn: str, *, server: bool, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()):
    ca_cert, ca_key = ca
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                               else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


class Certs:
    """PEM files in a folder: ca, server (localhost / 127.0.0.1), client; a foreign CA's client; a
    server certificate for the name `localhost` only."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        ca, foreign = make_ca("voxpipe test CA"), make_ca("some other CA")
        self.ca = self._write("ca.pem", ca[0])
        self.server, self.server_key = self._pair("server", issue(ca, "voxpipe stage", server=True,
                                                                   dns=("localhost",), ips=("127.0.0.1",)))
        self.client, self.client_key = self._pair("client", issue(ca, "voxpipe gateway", server=False))
        self.foreign_client, self.foreign_client_key = self._pair("foreign-client",
                                                                  issue(foreign, "intruder", server=False))
        self.named, self.named_key = self._pair("named", issue(ca, "named", server=True, dns=("localhost",)))

    def _write(self, name: str, cert) -> str:
        path = self.folder / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    def _pair(self, name: str, pair) -> tuple[str, str]:
        cert, key = pair
        (self.folder / f"{name}-key.pem").write_bytes(_pem_key(key))
        return self._write(f"{name}.pem", cert), str(self.folder / f"{name}-key.pem")

    def read(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def client_tls(self, cert: bool = True) -> ClientTLS:
        return ClientTLS.from_files(self.ca, self.client if cert else None, self.client_key if cert else None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return Certs(tmp_path_factory.mktemp("tls"))


# ----------------------------------------------------------------------------- the chain

@pytest.fixture(scope="module")
def mtls_stack(tiny_model_dir, certs):
    """Thinker -> talker -> code2wav, each serving mTLS (its client CA: the test CA) and calling the
    next stage with the client certificate."""
    from voxpipe.cli import LocalStack

    ports = [free_port() for _ in STAGES]
    flags = [f"--tls-cert={certs.server}", f"--tls-key={certs.server_key}", f"--tls-client-ca={certs.ca}",
             f"--tls-ca={certs.ca}", f"--tls-client-cert={certs.client}", f"--tls-client-key={certs.client_key}"]
    st = LocalStack(tiny_model_dir, "127.0.0.1", ports[0], "cpu", extra=flags)
    st.ports = dict(zip(STAGES, ports))
    st.start(timeout=240)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def tls_gateway(mtls_stack, tiny_model_dir, certs):
    """The gateway serving HTTPS / WSS and TLS on Converse, calling the stages with its client certificate."""
    grpc_port = free_port()
    process = GatewayProcess(tiny_model_dir, mtls_stack.address("thinker"), mtls_stack.address("code2wav"),
                             "--grpc-port", str(grpc_port), f"--ssl-certfile={certs.server}",
                             f"--ssl-keyfile={certs.server_key}", f"--tls-ca={certs.ca}",
                             f"--tls-client-cert={certs.client}", f"--tls-client-key={certs.client_key}")
    process.base_url = f"https://127.0.0.1:{process.port}"
    process.grpc = f"127.0.0.1:{grpc_port}"
    yield process
    process.stop()


def trust(certs: Certs) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=certs.ca)


def collect(stack, tls: ClientTLS | None, **kw):
    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav"), tls=tls) as pc:
            text, pcm, done = "", bytearray(), None
            async for ev in pc.stream(SpeechRequest(encoding=pb.AUDIO_PCM16, **kw)):
                if isinstance(ev, TextEvent):
                    text += ev.text
                elif isinstance(ev, AudioEvent):
                    pcm += ev.data
                elif isinstance(ev, DoneEvent):
                    done = ev
            return text, bytes(pcm), done
    return asyncio.run(go())


def health_check(address: str, credentials: grpc.ChannelCredentials | None, service: str = "") -> str:
    """SERVING, or the status code's name of a refused call."""
    ch = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with ch:
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)
        except grpc.RpcError as e:
            return e.code().name


# ----------------------------------------------------------------------------- mTLS between stages

def test_spoken_reply_through_the_mtls_chain(mtls_stack, certs):
    text, pcm, done = collect(mtls_stack, certs.client_tls(), text="Hello there", max_tokens=4, min_tokens=4,
                              max_frames=6, min_frames=6)
    assert done is not None and done.completion_tokens == 4 and done.frames == 5
    assert text and len(pcm) == 2 * done.samples > 0
    assert done.routes["talker"] == mtls_stack.address("talker")          # the thinker dialled it over mTLS
    assert done.routes["code2wav"] == mtls_stack.address("code2wav")      # and the talker its code2wav


def test_only_clients_with_a_certificate_of_the_ca_get_in(mtls_stack, certs):
    ca, cert, key = certs.read(certs.ca), certs.read(certs.client), certs.read(certs.client_key)
    foreign = grpc.ssl_channel_credentials(ca, certs.read(certs.foreign_client_key), certs.read(certs.foreign_client))
    for stage in STAGES:
        address = mtls_stack.address(stage)
        assert health_check(address, grpc.ssl_channel_credentials(ca, key, cert), HEALTH[stage]) == "SERVING"
        assert health_check(address, None) == "UNAVAILABLE"                                   # plaintext
        assert health_check(address, grpc.ssl_channel_credentials(ca)) == "UNAVAILABLE"       # no client cert
        assert health_check(address, foreign) == "UNAVAILABLE"                                # another CA's cert
    # the pipeline client without a certificate is refused too (before its first response)
    with pytest.raises(Exception) as refused:
        collect(mtls_stack, certs.client_tls(cert=False), text="Hi", max_tokens=2, audio=False)
    assert "UNAVAILABLE" in str(refused.value)


def test_dns_replicas_are_checked_against_the_name(certs):
    """A dns:///name:port entry's replicas are dialled by IP address; their certificate (here for
    `localhost` only, no IP) is checked against the name."""
    async def go():
        server = grpc.aio.server()
        health = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        tls = ServerTLS.from_files(certs.named, certs.named_key, certs.ca)
        port = server.add_secure_port("127.0.0.1:0", tls.credentials())
        await server.start()
        balancer = StageBalancer("talker", f"dns:///localhost:{port}", channel_options=[], tls=certs.client_tls())
        by_ip = StageBalancer("talker", f"127.0.0.1:{port}", channel_options=[], tls=certs.client_tls())
        try:
            await balancer.start()
            [replica] = [r for r in balancer.replicas if r.address == f"127.0.0.1:{port}"]
            ok = await health_pb2_grpc.HealthStub(replica.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as refused:     # the same IP, dialled as an IP: no match
                await health_pb2_grpc.HealthStub(by_ip.replicas[0].channel).Check(health_pb2.HealthCheckRequest(),
                                                                                 timeout=5)
            return ok.status, refused.value.code()
        finally:
            await balancer.close()
            await by_ip.close()
            await server.stop(None)

    assert asyncio.run(go()) == (health_pb2.HealthCheckResponse.SERVING, grpc.StatusCode.UNAVAILABLE)


# ----------------------------------------------------------------------------- the gateway over TLS

def test_openai_sdk_over_https(tls_gateway, certs, tiny_model_dir):
    with httpx.Client(verify=trust(certs)) as http:
        client = openai.OpenAI(base_url=f"{tls_gateway.base_url}/v1", api_key="unused", max_retries=0,
                               http_client=http)
        resp = client.chat.completions.create(
            model=tiny_model_dir.name, messages=[{"role": "user", "content": "Say hello."}],
            modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"}, temperature=0, max_tokens=4,
            extra_body={"ignore_eos": True, "max_audio_frames": 6})
        assert resp.choices[0].message.audio.data and resp.usage.completion_tokens_details.audio_tokens == 5
        ready = http.get(f"{tls_gateway.base_url}/ready")          # its health checks of the stages use mTLS too
        assert ready.status_code == 200 and ready.json()["ready"] is True
    with pytest.raises(httpx.ConnectError):                        # the test CA is not a public one
        httpx.get(f"{tls_gateway.base_url}/health")
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):   # no plaintext HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{tls_gateway.port}/health")


def test_converse_over_tls(tls_gateway, certs):
    with grpc.secure_channel(tls_gateway.grpc, grpc.ssl_channel_credentials(certs.read(certs.ca))) as ch:
        start = gw.ConverseStart(text="Hello there", voice="chelsie", max_tokens=4, max_frames=6, ignore_eos=True,
                                 sampling=pb.Sampling(temperature=0.0))
        responses = list(gw_grpc.GatewayStub(ch).Converse(iter([gw.ConverseRequest(start=start)]), timeout=120))
    done = responses[-1].done
    assert done.usage.completion_tokens == 4 and done.usage.audio_frames == 5
    assert any(r.WhichOneof("kind") == "audio" for r in responses)
    assert health_check(tls_gateway.grpc, None) == "UNAVAILABLE"      # no plaintext on the Converse port


def test_python_sdk_realtime_client_over_wss(tls_gateway, certs, tiny_model_dir):
    """The Python SDK's realtime client over wss:// trusts the CA given to its socket
    (`websocket_connection_options={"ssl": ctx}`, as the README says): the http_client's verify=
    does not reach the WebSocket."""
    ctx = trust(certs)
    with httpx.Client(verify=ctx) as http:
        client = openai.OpenAI(base_url=f"{tls_gateway.base_url}/v1", api_key="unused", max_retries=0,
                               http_client=http)
        with client.realtime.connect(model=tiny_model_dir.name, websocket_connection_options={"ssl": ctx}) as conn:
            conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": "Hello"}]})
            conn.response.create(response={"max_output_tokens": 2})
            kinds = []
            for event in conn:
                kinds.append(event.type)
                if event.type in ("response.done", "error"):
                    break
        assert kinds[0] == "session.created" and kinds[-1] == "response.done", kinds
        with pytest.raises(ssl.SSLError):          # without it the socket does not trust the test CA
            with client.realtime.connect(model=tiny_model_dir.name):
                pass


@pytest.fixture(scope="module")
def node_realtime(tmp_path_factory) -> Path:
    return install_node_package(tmp_path_factory, "node_realtime", "realtime.mjs", "transcribe.mjs")


def test_node_sdk_realtime_client_over_wss(tls_gateway, certs, tiny_model_dir, node_realtime):
    """The Node SDK's realtime client always dials wss://: unchanged, it reaches the gateway
    (trusting the test CA the standard Node way, NODE_EXTRA_CA_CERTS) and completes a spoken turn."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "NODE_EXTRA_CA_CERTS": certs.ca, "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(["node", "realtime.mjs", f"{tls_gateway.base_url}/v1", tiny_model_dir.name, "Hello there",
                           "4", "6"], cwd=node_realtime, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["url"].startswith(f"wss://127.0.0.1:{tls_gateway.port}/v1/realtime?model=")
    assert out["events"][0] == "session.created" and "session.updated" in out["events"]
    assert out["audio_bytes"] > 0 and out["transcript"] and out["events"][-1] == "response.done"
    assert out["status"] in ("completed", "incomplete")


def test_node_sdk_realtime_client_gets_the_transcription(tls_gateway, mtls_stack, certs, tiny_model_dir, tokenizer,
                                                         omni_config, node_realtime, tmp_path):
    """The Node SDK's realtime client, unchanged, asks for input audio transcription by the served
    model: the committed clip's transcript is the pipeline's text for the transcription prompt."""
    import numpy as np

    from voxpipe.audio import resample_clip
    from voxpipe.gateway.realtime.session import TranscriptionSettings
    from voxpipe.gateway.realtime.transcription import TranscriptionJob, max_tokens, transcription_messages
    from voxpipe.services.thinker.prompt import FeatureExtractor, render

    pcm = (np.random.default_rng(3).normal(0, 0.1, 24000) * 32767).round().astype("<i2")
    (tmp_path / "clip.pcm16").write_bytes(pcm.tobytes())
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "NODE_EXTRA_CA_CERTS": certs.ca, "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(["node", str(node_realtime / "transcribe.mjs"), f"{tls_gateway.base_url}/v1",
                           tiny_model_dir.name, str(tmp_path / "clip.pcm16")], cwd=node_realtime,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["events"][0] == "session.created" and "input_audio_buffer.committed" in out["events"]
    features = FeatureExtractor.for_model(tiny_model_dir)(resample_clip(pcm.astype(np.float32) / 32768.0, 24000, 16000))
    prompt = render(tokenizer, omni_config.thinker, transcription_messages(
        TranscriptionJob("item", 0, features, len(pcm), TranscriptionSettings())))
    text, _, done = collect(mtls_stack, certs.client_tls(), token_ids=prompt.token_ids,
                            audio_features=prompt.audio_features, audio=False, max_tokens=max_tokens(len(pcm)))
    assert text and out["transcript"] == out["deltas"] == text
    assert out["usage"]["type"] == "tokens" and out["usage"]["output_tokens"] == done.completion_tokens
    assert out["usage"]["input_tokens"] == len(prompt.token_ids)


# ----------------------------------------------------------------------------- bad flags

@pytest.mark.parametrize("argv, message", [
    (["thinker", "--tls-cert={cert}"], "--tls-cert is given without --tls-key"),
    (["talker", "--tls-client-ca={ca}"], "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"),
    (["thinker", "--tls-ca={ca}", "--tls-client-cert={cert}"], "--tls-client-cert is given without --tls-client-key"),
    (["code2wav", "--tls-cert={cert}", "--tls-key=/nonexistent.pem"], "--tls-key /nonexistent.pem: cannot read it"),
    (["gateway", "--ssl-keyfile={key}", "--http-port=0"], "--ssl-keyfile is given without --ssl-certfile"),
])
def test_half_configured_tls_is_refused_at_start(certs, tiny_model_dir, argv, message):
    argv = [a.format(cert=certs.server, key=certs.server_key, ca=certs.ca) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", *argv, f"--model={tiny_model_dir}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_tls_config_errors_in_process(certs, tmp_path):
    assert ServerTLS.from_files(None, None, None) is None and ClientTLS.from_files(None) is None
    assert ServerTLS.from_files(certs.server, certs.server_key, certs.ca).mutual
    with pytest.raises(TLSConfigError, match="--tls-client-cert/--tls-client-key are given without --tls-ca"):
        ClientTLS.from_files(None, certs.client, certs.client_key)
    with pytest.raises(TLSConfigError, match="--tls-server-name is given without --tls-ca"):
        ClientTLS.from_files(None, server_name="voxpipe-talker")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TLSConfigError, match="not a PEM file"):
        ServerTLS.from_files(str(tmp_path / "junk.pem"), certs.server_key)
