"""deploy/ against the code: every flag, SPECDEC_* variable, port, service address and health
probe in the Dockerfile, the compose file and the Kubernetes manifests must be what the
services' own parsers accept and what they actually listen on, so the files cannot drift.

Each container is checked by running its service's real `parse_config` on the container's
command line and environment (image ENV, then compose `environment` or ConfigMap + `env`)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import coordinator.config
import draft_service.config
import target_service.config
from coordinator.metrics import PoolCollector
from coordinator.pools import Pool
from specdec.rpc.dns import parse_pool
from specdec.rpc.serving import LIVENESS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONFIGS: dict[str, ModuleType] = {
    "draft_service": draft_service.config,
    "target_service": target_service.config,
    "coordinator": coordinator.config,
}
# What each service needs to parse at all; used only to learn which variables it reads.
REQUIRED_ENV = {
    "draft_service": {"SPECDEC_DRAFT_MODEL": "m"},
    "target_service": {"SPECDEC_TARGET_MODEL": "m"},
    "coordinator": {
        "SPECDEC_COORDINATOR_DRAFT": "d:1",
        "SPECDEC_COORDINATOR_TARGET": "t:2",
        "SPECDEC_COORDINATOR_TOKENIZER": "m",
    },
}
SERVICE_PREFIX = re.compile(r"^SPECDEC_(DRAFT|TARGET|COORDINATOR)_")


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


healthcheck = load_module(DEPLOY / "healthcheck.py")
render = load_module(DEPLOY / "render.py")


class RecordingEnv(Mapping[str, str]):
    """An environment that remembers every name the parser looks up."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)
        self.looked_up: set[str] = set()

    def __contains__(self, name: object) -> bool:
        self.looked_up.add(str(name))
        return name in self.values

    def __getitem__(self, name: str) -> str:
        self.looked_up.add(name)
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def variables_read(module: str) -> set[str]:
    env = RecordingEnv(REQUIRED_ENV[module])
    CONFIGS[module].parse_config([], env)
    return {name for name in env.looked_up if name.startswith("SPECDEC_")}


READS = {module: variables_read(module) for module in CONFIGS}


# --- the Dockerfile ----------------------------------------------------------------------


@dataclass
class Image:
    env: dict[str, str]
    user: str
    healthcheck_cmd: list[str]
    cmd: list[str]
    exposed: set[int]
    copies: list[list[str]]
    volumes: list[str]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    logical, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not pending.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    return [
        (words[0].upper(), words[1] if len(words) > 1 else "")
        for line in logical
        if (words := line.strip().split(None, 1))
    ]


def substitute(value: str, variables: Mapping[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), m.group(0)), value)


def runtime_image() -> Image:
    """The last stage of deploy/docker/Dockerfile, with ARG defaults substituted."""
    instructions = dockerfile_instructions((DEPLOY / "docker" / "Dockerfile").read_text())
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    image = Image(env={}, user="root", healthcheck_cmd=[], cmd=[], exposed=set(), copies=[], volumes=[])
    variables: dict[str, str] = {}
    for name, rest in instructions[last_from + 1 :]:
        if name == "ARG":
            key, _, default = rest.partition("=")
            variables[key] = default
        elif name == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                image.env[key] = variables[key] = substitute(value, variables)
        elif name == "USER":
            image.user = substitute(rest, variables)
        elif name == "HEALTHCHECK":
            image.healthcheck_cmd = json.loads(rest.split(" CMD ", 1)[1])
        elif name == "CMD":
            image.cmd = json.loads(rest)
        elif name == "EXPOSE":
            image.exposed = {int(port) for port in rest.split()}
        elif name == "COPY":
            image.copies.append(rest.split())
        elif name == "VOLUME":
            image.volumes = json.loads(rest)
    return image


IMAGE = runtime_image()


# --- containers from compose and Kubernetes ------------------------------------------------


@dataclass
class Container:
    where: str  # for messages: "compose draft", "k8s specdec-draft"
    module: str
    argv: list[str]  # after `python -m module`
    env: dict[str, str]
    mounts: list[str]
    files: dict[str, str] = field(
        default_factory=dict
    )  # secret files: container path -> source (host file or Secret key)

    def config(self):
        """The service's config, parsed as the service parses it (choices included)."""
        parse = CONFIGS[self.module].parse_config
        try:
            return parse(self.argv, self.env)
        except SystemExit as exc:
            pytest.fail(
                f"{self.where}: `python -m {self.module} {' '.join(self.argv)}` does not parse with its environment: "
                f"{exc}"
            )

    def own_variables(self) -> set[str]:
        prefix, _ = healthcheck.SERVICES[self.module]
        return {name for name in self.env if name.startswith(prefix + "_")}


def service_command(command: list[str], where: str) -> tuple[str, list[str]]:
    assert command[:2] == ["python", "-m"] and command[2] in CONFIGS, f"{where}: {command} starts no specdec service"
    return command[2], command[3:]


INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose_interpolations(node: Any) -> Iterator[tuple[str, str | None]]:
    if isinstance(node, str):
        for match in INTERPOLATION.finditer(node):
            yield match.group(1), match.group(2)
    elif isinstance(node, dict):
        for value in node.values():
            yield from compose_interpolations(value)
    elif isinstance(node, list):
        for value in node:
            yield from compose_interpolations(value)


def with_defaults(node: Any) -> Any:
    """The compose file as Compose sees it when none of its variables is set."""
    if isinstance(node, str):

        def default(match: re.Match) -> str:
            assert match.group(2) is not None, f"compose variable {match.group(1)} has no default"
            return match.group(2)

        return INTERPOLATION.sub(default, node)
    if isinstance(node, dict):
        return {key: with_defaults(value) for key, value in node.items()}
    if isinstance(node, list):
        return [with_defaults(value) for value in node]
    return node


def merge_compose(base: Any, override: Any, where: str = "") -> Any:
    """`docker compose -f base -f override` for what these files use: mappings merge, and the
    only list an override may replace is a command or a health-check test."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {
            key: merge_compose(base[key], override[key], f"{where}.{key}")
            if key in base and key in override
            else override.get(key, base.get(key))
            for key in {**base, **override}
        }
    assert not isinstance(base, list) or where.endswith((".command", ".test")), (
        f"compose override replaces the list {where}"
    )
    return override


COMPOSE_RAW = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
COMPOSE_TLS_RAW = yaml.safe_load((DEPLOY / "compose.tls.yaml").read_text())
COMPOSE = with_defaults(COMPOSE_RAW)["services"]
COMPOSE_TLS_FILE = with_defaults(merge_compose(COMPOSE_RAW, COMPOSE_TLS_RAW))
COMPOSE_TLS = COMPOSE_TLS_FILE["services"]
COMPOSE_POOLS = with_defaults(merge_compose(COMPOSE_RAW, yaml.safe_load((DEPLOY / "compose.pools.yaml").read_text())))[
    "services"
]


def compose_containers(
    services: dict = COMPOSE, secrets: dict | None = None, label: str = "compose"
) -> dict[str, Container]:
    containers = {}
    for name, service in services.items():
        command = service.get("command")
        if not command or command[:2] != ["python", "-m"]:
            continue
        module, argv = service_command(command, f"{label} {name}")
        env = {**IMAGE.env, **{key: str(value) for key, value in service.get("environment", {}).items()}}
        mounts = [volume.split(":")[1] for volume in service.get("volumes", [])]
        files = {}
        for secret in service.get("secrets", []):
            assert secret["source"] in (secrets or {}), f"{label} {name}: no top-level secret {secret['source']}"
            files[f"/run/secrets/{secret['target']}"] = secrets[secret["source"]]["file"]
        containers[name] = Container(f"{label} {name}", module, argv, env, mounts, files)
    return containers


K8S = render.render(DEPLOY / "k8s")
K8S_TLS = render.render(DEPLOY / "k8s" / "tls")
K8S_MONITORING = render.render(DEPLOY / "k8s" / "monitoring")
NAMESPACE = render.load_kustomization(DEPLOY / "k8s")["namespace"]


def k8s(kind: str, documents: list[dict] = K8S) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == kind}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def k8s_containers(documents: list[dict] = K8S, label: str = "k8s") -> dict[str, tuple[Container, dict, dict]]:
    """Deployment name -> (the service container, its manifest, the Deployment)."""
    config_maps = k8s("ConfigMap", documents)
    found = {}
    for name, deployment in k8s("Deployment", documents).items():
        for manifest in pod_spec(deployment)["containers"]:
            if manifest.get("command", [])[:2] != ["python", "-m"]:
                continue
            module, argv = service_command(manifest["command"] + manifest.get("args", []), f"{label} {name}")
            env = dict(IMAGE.env)
            for source in manifest.get("envFrom", []):
                ref = source["configMapRef"]["name"]
                assert ref in config_maps, (
                    f"k8s {name}: envFrom names ConfigMap {ref}, which is not in the kustomization"
                )
                data = config_maps[ref]["data"]
                assert all(isinstance(value, str) for value in data.values()), (
                    f"ConfigMap {ref}: quote non-string values"
                )
                env.update(data)
            env.update({item["name"]: item["value"] for item in manifest.get("env", []) if "value" in item})
            mounts = [mount["mountPath"] for mount in manifest.get("volumeMounts", [])]
            files = secret_files(pod_spec(deployment), manifest)
            found[name] = (Container(f"{label} {name}", module, argv, env, mounts, files), manifest, deployment)
    return found


def secret_files(spec: dict, manifest: dict) -> dict[str, str]:
    """Files that Secret volumes put in the container: path -> "SECRET/KEY"."""
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    files = {}
    for mount in manifest.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = [source["secret"] for source in volume.get("projected", {}).get("sources", []) if "secret" in source]
        if "secret" in volume:
            sources.append({"name": volume["secret"]["secretName"], **volume["secret"]})
        for secret in sources:
            assert "items" in secret, (
                f"{manifest['name']}: Secret {secret['name']} is mounted whole; list the files it needs"
            )
            for item in secret["items"]:
                files[f"{mount['mountPath'].rstrip('/')}/{item['path']}"] = f"{secret['name']}/{item['key']}"
    return files


COMPOSE_CONTAINERS = compose_containers()
K8S_CONTAINERS = k8s_containers()
COMPOSE_TLS_CONTAINERS = compose_containers(COMPOSE_TLS, COMPOSE_TLS_FILE["secrets"], "compose+tls")
K8S_TLS_CONTAINERS = k8s_containers(K8S_TLS, "k8s/tls")
ALL_CONTAINERS = [
    *COMPOSE_CONTAINERS.values(),
    *(container for container, _, _ in K8S_CONTAINERS.values()),
    *COMPOSE_TLS_CONTAINERS.values(),
    *(container for container, _, _ in K8S_TLS_CONTAINERS.values()),
]


def by_module(containers: Mapping[str, Container], module: str) -> tuple[str, Container]:
    [(name, container)] = [(name, c) for name, c in containers.items() if c.module == module]
    return name, container


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_every_deployment_runs_all_three_services():
    """Containers are found by their `python -m <service>` command; if that form changed, the
    checks below would pass on nothing."""
    for containers in (COMPOSE_CONTAINERS, {name: c for name, (c, _, _) in K8S_CONTAINERS.items()}):
        assert sorted(c.module for c in containers.values()) == sorted(CONFIGS)


# --- flags and variables -----------------------------------------------------------------


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_command_line_and_environment_parse(container):
    config = container.config()
    assert config.host == "0.0.0.0", f"{container.where} listens on {config.host}, unreachable from other containers"


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_service_variables_are_ones_the_service_reads(container):
    unread = container.own_variables() - READS[container.module]
    assert not unread, f"{container.where} sets {sorted(unread)}, which {container.module} never reads"


def test_every_specdec_variable_in_deploy_files_is_read_by_a_service():
    named = set(IMAGE.env) | set(k8s("ConfigMap", K8S_TLS)["specdec-config"]["data"])
    for service in COMPOSE_TLS.values():
        named |= set(service.get("environment", {}))
    read_by_any = set().union(*READS.values())
    stray = {name for name in named if SERVICE_PREFIX.match(name)} - read_by_any
    assert not stray, f"no service reads {sorted(stray)}"


def test_compose_variables_with_a_service_prefix_are_that_services_settings():
    """`${SPECDEC_TARGET_MODEL:-x}` must mean the target's own SPECDEC_TARGET_MODEL, with the
    default the target uses; a compose-only knob must not look like a service setting."""
    settings = {}
    for service in COMPOSE_RAW["services"].values():
        for key, value in service.get("environment", {}).items():
            if match := INTERPOLATION.fullmatch(str(value)):
                if match.group(1) == key:
                    settings[key] = match.group(2)
    for name, default in compose_interpolations(COMPOSE_RAW):
        if SERVICE_PREFIX.match(name):
            assert name in settings, f"compose variable {name} looks like a service setting but sets none"
            assert default == settings[name], f"compose uses {name} with defaults {default!r} and {settings[name]!r}"


def test_image_sets_model_paths_under_its_volume():
    for name in ("SPECDEC_DRAFT_MODEL", "SPECDEC_TARGET_MODEL", "SPECDEC_COORDINATOR_TOKENIZER"):
        assert any(IMAGE.env[name].startswith(volume + "/") for volume in IMAGE.volumes), f"{name}={IMAGE.env[name]}"
    assert IMAGE.env["SPECDEC_COORDINATOR_TOKENIZER"] == IMAGE.env["SPECDEC_TARGET_MODEL"]


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_model_folders_are_on_a_mounted_volume(container):
    config = container.config()
    path = config.tokenizer if container.module == "coordinator" else config.model
    assert any(path.startswith(mount.rstrip("/") + "/") for mount in container.mounts), (
        f"{container.where}: {path} is on no mounted volume"
    )


@pytest.mark.parametrize(
    "containers", [COMPOSE_CONTAINERS, {n: c for n, (c, _, _) in K8S_CONTAINERS.items()}], ids=["compose", "k8s"]
)
def test_coordinator_tokenizer_is_the_targets_model(containers):
    """The coordinator checks its tokenizer against the target's fingerprint at start-up."""
    _, coordinator_container = by_module(containers, "coordinator")
    _, target = by_module(containers, "target_service")
    assert coordinator_container.config().tokenizer == target.config().model


# --- compose: ports, addresses, health, GPUs -----------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPOSE_CONTAINERS))
def test_compose_ports_and_health_probe_match_the_listening_port(name):
    container = COMPOSE_CONTAINERS[name]
    port = container.config().port
    service = COMPOSE[name]
    published = {int(mapping.rsplit(":", 1)[1]) for mapping in service.get("ports", [])}
    listening = {port} | ({http} if (http := getattr(container.config(), "http_port", -1)) >= 0 else set())
    assert published <= listening, f"compose {name} publishes container port(s) {published}, it listens on {listening}"
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", *IMAGE.healthcheck_cmd], f"compose {name} health check is not the image's probe: {test}"
    assert split_address(test[3]) == ("127.0.0.1", port)
    # Without the explicit address, the image's own HEALTHCHECK would find the same port.
    assert healthcheck.service_port(["python", "-m", container.module, *container.argv], container.env) == port


@pytest.mark.parametrize("role", ["draft", "target"])
def test_compose_coordinator_reaches_the_services_it_waits_for(role):
    coordinator_name, coordinator_container = by_module(COMPOSE_CONTAINERS, "coordinator")
    config = coordinator_container.config()
    host, port = split_address(config.draft_address if role == "draft" else config.target_address)
    assert host in COMPOSE_CONTAINERS, f"coordinator's {role} address names {host}, not a compose service"
    assert COMPOSE_CONTAINERS[host].module == f"{role}_service"
    assert COMPOSE_CONTAINERS[host].config().port == port
    assert COMPOSE[coordinator_name]["depends_on"][host] == {"condition": "service_healthy"}


def test_compose_pools_coordinator_reaches_every_target_replica_of_one_model():
    containers = compose_containers(COMPOSE_POOLS, label="compose+pools")
    coordinator_name, coordinator_container = by_module(containers, "coordinator")
    pool = parse_pool(coordinator_container.config().target_address)
    assert len(pool.addresses) == 2
    replicas = []
    for address in pool.addresses:
        host, port = split_address(address)
        assert containers[host].module == "target_service" and containers[host].config().port == port
        assert COMPOSE_POOLS[coordinator_name]["depends_on"][host] == {"condition": "service_healthy"}
        replicas.append(containers[host].config())
    first, second = replicas
    assert (first.model, first.dtype, first.quantize) == (second.model, second.dtype, second.quantize)
    gpus = [gpu_ids(COMPOSE_POOLS[name]) for name in containers if containers[name].module != "coordinator"]
    flat = [gpu for ids in gpus for gpu in ids]
    assert len(gpus) == 3 and len(flat) == len(set(flat)) == 5, f"GPUs reserved twice: {gpus}"


def gpu_ids(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [gpu for device in devices if "gpu" in device["capabilities"] for gpu in device["device_ids"]]


def test_compose_gpus_are_reserved_apart_and_used():
    draft_name, _ = by_module(COMPOSE_CONTAINERS, "draft_service")
    target_name, target = by_module(COMPOSE_CONTAINERS, "target_service")
    draft_gpus, target_gpus = gpu_ids(COMPOSE[draft_name]), gpu_ids(COMPOSE[target_name])
    assert len(draft_gpus) == 1 and len(target_gpus) == 2
    assert not set(draft_gpus) & set(target_gpus), "draft and target reserve the same GPU"
    assert target.config().device_map == "auto", "the target reserves two GPUs but would load on one"
    for container in COMPOSE_CONTAINERS.values():
        if container.module != "coordinator":
            device = container.config().device
            assert device == "auto" or device.startswith("cuda"), f"{container.where} reserves a GPU but runs on CPU"


def test_compose_otlp_endpoint_is_jaegers_receiver():
    jaeger_port = otlp_grpc_port(COMPOSE["jaeger"]["command"])
    for container in COMPOSE_CONTAINERS.values():
        endpoint = container.env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == f"http://jaeger:{jaeger_port}", f"{container.where}: {endpoint}"
        assert container.env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"


def otlp_grpc_port(jaeger_args: list[str]) -> int:
    [endpoint] = [
        arg.split("=", 2)[2] for arg in jaeger_args if arg.startswith("--set=receivers.otlp.protocols.grpc.endpoint=")
    ]
    host, port = split_address(endpoint)
    assert host == "0.0.0.0", "Jaeger's OTLP receiver would listen on loopback only"
    return port


# --- Kubernetes: probes, Services, addresses, placement ------------------------------------


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def target_port(service_port: dict, manifest: dict) -> int:
    target = service_port["targetPort"]
    if isinstance(target, int):
        return target
    [port] = [p["containerPort"] for p in manifest["ports"] if p["name"] == target]
    return port


def service_for(deployment: dict) -> dict:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    [service] = [s for s in k8s("Service").values() if selects(s["spec"]["selector"], labels)]
    return service


@pytest.mark.parametrize("name", sorted(K8S_CONTAINERS))
def test_k8s_probes_container_and_service_ports_match_the_listening_port(name):
    container, manifest, deployment = K8S_CONTAINERS[name]
    config = container.config()
    port = config.port
    expected = {"grpc": port, "metrics": config.metrics_port}
    if getattr(config, "http_port", -1) >= 0:  # the coordinator's OpenAI-compatible HTTP API
        expected["http"] = config.http_port
    assert {p["name"]: p["containerPort"] for p in manifest["ports"]} == expected
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == config.metrics_port
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert manifest[probe]["grpc"]["port"] == port, (
            f"{name} {probe} asks port {manifest[probe]['grpc']['port']}, the service listens on {port}"
        )
    service_ports = {p["name"]: target_port(p, manifest) for p in service_for(deployment)["spec"]["ports"]}
    assert service_ports == expected  # metrics too: the ServiceMonitor scrapes through the Service


@pytest.mark.parametrize("name", sorted(K8S_CONTAINERS))
def test_k8s_service_links_cannot_override_settings(name):
    """Kubernetes injects NAME_PORT=tcp://... for every Service; with a Service named
    specdec-draft that is SPECDEC_DRAFT_PORT, which the draft reads as its port."""
    container, _, deployment = K8S_CONTAINERS[name]
    injected = set()
    for service in k8s("Service"):
        prefix = service.upper().replace("-", "_")
        injected |= {f"{prefix}_PORT", f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT"}
    if injected & READS[container.module]:
        assert pod_spec(deployment).get("enableServiceLinks") is False, (
            f"{name} would read Service link variables {sorted(injected & READS[container.module])}"
        )


def resolve_k8s_address(address: str) -> tuple[dict, int]:
    """The Deployment a cluster address reaches (Service name, optionally namespaced), and
    the container port it lands on. A pool found by DNS (dns:///NAME:PORT) must name a
    headless Service: a ClusterIP would resolve to one address, and the pool to one replica."""
    pool = parse_pool(address)
    host, port = (pool.name, pool.port) if pool.dynamic else split_address(address)
    service_name, *domain = host.split(".")
    if domain:
        assert domain[0] == NAMESPACE, f"{address} is in another namespace"
    services = k8s("Service")
    assert service_name in services, f"{address}: no Service {service_name}"
    service = services[service_name]
    if pool.dynamic:
        assert service["spec"].get("clusterIP") == "None", f"{address}: Service {service_name} is not headless"
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == port]
    [deployment] = [
        d
        for d in k8s("Deployment").values()
        if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    [manifest] = [
        c
        for c in pod_spec(deployment)["containers"]
        if any(
            p.get("name") == service_port["targetPort"] or p["containerPort"] == service_port["targetPort"]
            for p in c["ports"]
        )
    ]
    return deployment, target_port(service_port, manifest)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_k8s_coordinator_addresses_reach_the_right_service(role):
    _, coordinator_container = by_module({n: c for n, (c, _, _) in K8S_CONTAINERS.items()}, "coordinator")
    config = coordinator_container.config()
    deployment, port = resolve_k8s_address(config.draft_address if role == "draft" else config.target_address)
    container, _, _ = K8S_CONTAINERS[deployment["metadata"]["name"]]
    assert container.module == f"{role}_service"
    assert container.config().port == port


def test_k8s_otlp_endpoint_reaches_jaegers_receiver():
    for name, (container, _, _) in K8S_CONTAINERS.items():
        endpoint = container.env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint.startswith("http://"), endpoint
        deployment, port = resolve_k8s_address(endpoint.removeprefix("http://"))
        [jaeger] = pod_spec(deployment)["containers"]
        assert port == otlp_grpc_port(jaeger["args"]), f"{name}: {endpoint} does not reach Jaeger's OTLP gRPC receiver"


def required_anti_affinity(deployment: dict) -> list[dict]:
    return pod_spec(deployment)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_k8s_draft_and_target_get_their_own_gpu_nodes():
    draft_name, _ = by_module({n: c for n, (c, _, _) in K8S_CONTAINERS.items()}, "draft_service")
    target_name, target = by_module({n: c for n, (c, _, _) in K8S_CONTAINERS.items()}, "target_service")
    deployments = k8s("Deployment")
    for this, other in ((draft_name, target_name), (draft_name, target_name)[::-1]):
        other_labels = deployments[other]["spec"]["template"]["metadata"]["labels"]
        assert any(
            term["topologyKey"] == "kubernetes.io/hostname"
            and selects(term["labelSelector"]["matchLabels"], other_labels)
            for term in required_anti_affinity(deployments[this])
        ), f"nothing keeps {this} off {other}'s node"
    gpus = {
        name: K8S_CONTAINERS[name][1]["resources"]["limits"]["nvidia.com/gpu"] for name in (draft_name, target_name)
    }
    assert gpus == {draft_name: 1, target_name: 2}
    assert target.config().device_map == "auto", "the target requests two GPUs but would load on one"
    assert K8S_CONTAINERS[draft_name][0].config().device.startswith("cuda")


def test_k8s_pods_run_as_the_images_non_root_user():
    uid, gid = (int(part) for part in IMAGE.user.split(":"))
    for name, (_, manifest, deployment) in K8S_CONTAINERS.items():
        security = pod_spec(deployment)["securityContext"]
        assert security["runAsNonRoot"] is True
        assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid), (
            f"{name} runs as another user than the image's"
        )
        assert manifest["securityContext"]["readOnlyRootFilesystem"] is True
        # A read-only root needs a writable /tmp: HF_HOME points there.
        assert IMAGE.env["HF_HOME"].startswith("/tmp/") and "/tmp" in K8S_CONTAINERS[name][0].mounts


def test_k8s_pdb_and_network_policies_select_real_pods():
    deployments = k8s("Deployment")
    for pdb in k8s("PodDisruptionBudget").values():
        [deployment] = [
            d
            for d in deployments.values()
            if selects(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"], (
            "the PDB would block every voluntary eviction"
        )
    coordinator_labels = deployments[by_module({n: c for n, (c, _, _) in K8S_CONTAINERS.items()}, "coordinator")[0]][
        "spec"
    ]["template"]["metadata"]["labels"]
    for policy in k8s("NetworkPolicy").values():
        [protected] = [
            n
            for n, d in deployments.items()
            if selects(policy["spec"]["podSelector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        ]
        config = K8S_CONTAINERS[protected][0].config()
        [rule, metrics_rule] = policy["spec"]["ingress"]
        assert [p["port"] for p in rule["ports"]] == [config.port]
        assert selects(rule["from"][0]["podSelector"]["matchLabels"], coordinator_labels), (
            f"{policy['metadata']['name']} shuts out the coordinator"
        )
        assert [p["port"] for p in metrics_rule["ports"]] == [config.metrics_port], (
            "Prometheus must reach the metrics port"
        )


def test_compose_prometheus_scrapes_each_service_on_its_metrics_port():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        target for job in config["scrape_configs"] for group in job["static_configs"] for target in group["targets"]
    }
    expected = {f"{name}:{container.config().metrics_port}" for name, container in COMPOSE_CONTAINERS.items()}
    assert targets == expected
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in COMPOSE["prometheus"]["volumes"]


def test_k8s_volumes_and_config_maps_exist():
    claims = k8s("PersistentVolumeClaim")
    for name, (_, _, deployment) in K8S_CONTAINERS.items():
        for volume in pod_spec(deployment)["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, (
                    f"{name}: no claim {volume['persistentVolumeClaim']['claimName']}"
                )


def test_kustomization_lists_every_manifest():
    listed = set(render.load_kustomization(DEPLOY / "k8s")["resources"])
    on_disk = {path.name for path in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    monitoring = render.load_kustomization(DEPLOY / "k8s" / "monitoring")
    used = set(monitoring["resources"]) | {patch["path"] for patch in monitoring["patches"]}
    on_disk = {path.name for path in (DEPLOY / "k8s" / "monitoring").glob("*.yaml")} - {"kustomization.yaml"}
    assert used == on_disk | {".."}


def matches(selector: dict, labels: Mapping[str, str]) -> bool:
    """A label selector with matchLabels and matchExpressions (In) against labels."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return selects(selector.get("matchLabels", {}), labels) and all(
        labels.get(e["key"]) in e["values"] for e in expressions
    )


def test_the_service_monitor_scrapes_each_services_metrics_port_and_nothing_else():
    """deploy/k8s/monitoring: the ServiceMonitor (a custom resource, which kubernetes-validate
    has no schema for) selects the coordinator, draft and target Services, each through a
    `metrics` port that reaches its container's --metrics-port; the rest is deploy/k8s as is."""
    (monitor,) = k8s("ServiceMonitor", K8S_MONITORING).values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == NAMESPACE
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"].endswith("s")
    selected = {
        name
        for name, service in k8s("Service", K8S_MONITORING).items()
        if matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    }
    assert selected == {"specdec-coordinator", "specdec-draft", "specdec-target"}
    for container, manifest, deployment in K8S_CONTAINERS.values():
        ports = {p["name"]: target_port(p, manifest) for p in service_for(deployment)["spec"]["ports"]}
        assert ports[endpoint["port"]] == container.config().metrics_port
    base = {(doc["kind"], doc["metadata"]["name"]) for doc in K8S}
    added = {(doc["kind"], doc["metadata"]["name"]) for doc in K8S_MONITORING} - base
    assert added == {("ServiceMonitor", "specdec"), ("HorizontalPodAutoscaler", "specdec-target")}


def test_the_target_autoscaler_scales_the_target_on_the_coordinators_queue():
    """The HorizontalPodAutoscaler owns the target Deployment's replica count (the overlay
    removes the fixed one) and reads the coordinators' own queue metric, by its exported name."""
    (hpa,) = k8s("HorizontalPodAutoscaler", K8S_MONITORING).values()
    reference = hpa["spec"]["scaleTargetRef"]
    target = k8s("Deployment", K8S_MONITORING)[reference["name"]]
    assert (
        reference["kind"] == "Deployment"
        and target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "target"
    )
    assert "replicas" not in target["spec"] and "replicas" in k8s("Deployment")[reference["name"]]["spec"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    name = metric["external"]["metric"]["name"]
    collected = {family.name for family in PoolCollector([Pool("target", parse_pool("t:1"), object)]).collect()}  # type: ignore[arg-type]
    assert name in collected and metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": "target"}


def test_render_applies_namespace_and_image_overrides():
    assert {doc["metadata"].get("namespace") for doc in K8S if doc["kind"] != "Namespace"} == {NAMESPACE}
    rules = [{"name": "registry.example.com/specdec", "newName": "r.io/team/specdec"}]
    assert render.retag("registry.example.com/specdec:0.1.0-cuda", rules) == "r.io/team/specdec:0.1.0-cuda"
    assert (
        render.retag("localhost:5000/specdec", [{"name": "localhost:5000/specdec", "newTag": "1"}])
        == "localhost:5000/specdec:1"
    )
    assert render.retag("jaegertracing/jaeger:2.13.0", rules) == "jaegertracing/jaeger:2.13.0"


# --- the image's health probe --------------------------------------------------------------


def test_image_health_probe_is_the_script_in_deploy():
    assert IMAGE.healthcheck_cmd[0] == "python"
    assert ["deploy/healthcheck.py", IMAGE.healthcheck_cmd[1]] in IMAGE.copies


@pytest.mark.parametrize("module", sorted(CONFIGS))
def test_health_probe_knows_each_services_port_and_variable(module):
    prefix, default_port = healthcheck.SERVICES[module]
    assert default_port == CONFIGS[module].DEFAULT_PORT
    assert f"{prefix}_PORT" in READS[module]
    assert default_port in IMAGE.exposed


@pytest.mark.parametrize("module", sorted(CONFIGS))
@pytest.mark.parametrize(
    "argv, env",
    [
        ([], {}),
        ([], {"PORT": "7001"}),
        (["--port", "7002"], {}),
        (["--port=7003"], {"PORT": "7001"}),
        (["--log-level", "DEBUG"], {"PORT": "7004"}),
    ],
)
def test_health_probe_finds_the_port_the_service_parses(module, argv, env):
    prefix, _ = healthcheck.SERVICES[module]
    env = {f"{prefix}_{key}": value for key, value in env.items()}
    expected = CONFIGS[module].parse_config(argv, {**REQUIRED_ENV[module], **env}).port
    assert healthcheck.service_port(["python", "-m", module, *argv], env) == expected


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_health_probe_passes_only_when_serving(health_server):
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address]) == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address]) == 0


def test_health_probe_fails_when_nothing_listens():
    assert healthcheck.check("127.0.0.1:1", timeout_s=1.0) is False


def test_health_probe_fails_when_nothing_listens_with_tls(tls_files):
    assert healthcheck.check("127.0.0.1:1", timeout_s=1.0, tls=healthcheck.ProbeTLS(tls_files.ca)) is False


# --- TLS: compose.tls.yaml and the k8s/tls overlay ------------------------------------------

make_certs = load_module(DEPLOY / "make_certs.py")
TLS_SETS = {
    "compose+tls": COMPOSE_TLS_CONTAINERS,
    "k8s/tls": {name: container for name, (container, _, _) in K8S_TLS_CONTAINERS.items()},
}
COMPONENT = {"draft_service": "draft", "target_service": "target", "coordinator": "coordinator"}


def source_name(source: str) -> str:
    """The file a secret comes from, whichever way it is mounted: "draft.crt", "internal-token"."""
    return source.rsplit("/", 1)[-1]


def mounted(container: Container, path: str | None, what: str) -> str:
    assert path, f"{container.where}: {what} is not set"
    assert path in container.files, (
        f"{container.where}: {what} {path} is not a mounted secret file ({sorted(container.files)})"
    )
    return source_name(container.files[path])


@pytest.mark.parametrize("containers", TLS_SETS.values(), ids=TLS_SETS.keys())
def test_tls_files_are_each_services_own_and_mounted(containers):
    """Every TLS and token setting names a mounted file; each service gets its own certificate
    and key (whose names the coordinator's addresses use), never the CA's key."""
    for container in containers.values():
        config, component = container.config(), COMPONENT[container.module]
        security = config.security
        assert mounted(container, security.tls_cert, "--tls-cert") == f"{component}.crt"
        assert mounted(container, security.tls_key, "--tls-key") == f"{component}.key"
        assert not any(source_name(source) == "ca.key" for source in container.files.values()), (
            f"{container.where} mounts the CA's key"
        )
        if container.module == "coordinator":
            assert mounted(container, config.upstream.tls_ca, "--upstream-tls-ca") == "ca.crt"
            assert mounted(container, config.upstream.tls_cert, "--upstream-tls-cert") == "coordinator.crt"
            assert mounted(container, config.upstream.tls_key, "--upstream-tls-key") == "coordinator.key"
            assert mounted(container, security.auth_token_file, "--auth-token-file") == "public-tokens"
            assert mounted(container, config.upstream.auth_token_file, "--upstream-auth-token-file") == "internal-token"
        else:
            assert mounted(container, security.tls_client_ca, "--tls-client-ca") == "ca.crt", (
                f"{container.where}: mutual TLS is off"
            )
            assert mounted(container, security.auth_token_file, "--auth-token-file") == "internal-token"


@pytest.mark.parametrize("containers", TLS_SETS.values(), ids=TLS_SETS.keys())
def test_tls_coordinator_reaches_draft_and_target_by_a_name_in_their_certificates(containers):
    _, coordinator_container = by_module(containers, "coordinator")
    config = coordinator_container.config()
    assert config.upstream.tls_server_name is None
    for address, component in ((config.draft_address, "draft"), (config.target_address, "target")):
        pool = parse_pool(address)
        host = pool.name if pool.dynamic else split_address(address)[0]  # a DNS pool's TLS checks its name
        assert host in make_certs.service_hosts(component, NAMESPACE), (
            f"{address} is not a name make_certs.py puts in {component}.crt"
        )


@pytest.mark.parametrize("containers", TLS_SETS.values(), ids=TLS_SETS.keys())
def test_tls_probe_verifies_with_the_ca_and_gets_past_mutual_tls(containers):
    """The probe runs with the container's environment and finds its service's settings: it must
    trust the CA that signed the service's certificate and, where the service requires client
    certificates, present one that CA signed."""
    k8s_manifests = {name: manifest for name, (_, manifest, _) in K8S_TLS_CONTAINERS.items()}
    for name, container in containers.items():
        if container.where.startswith("compose"):
            commands = [COMPOSE_TLS[name]["healthcheck"]["test"][1:]]
        else:
            probes = [k8s_manifests[name][probe] for probe in ("startupProbe", "readinessProbe", "livenessProbe")]
            assert all("grpc" not in probe for probe in probes), (
                f"{container.where}: kubelet's gRPC probes cannot speak TLS"
            )
            commands = [probe["exec"]["command"] for probe in probes]
        for command in commands:
            assert command[:2] == IMAGE.healthcheck_cmd, f"{container.where}: {command} is not the image's probe"
            assert command[2:4] == ["--tls-ca", command[3]], f"{container.where}: {command}"
            assert command[4:] in ([], ["--service", "liveness"]), f"{container.where}: {command}"
            tls = healthcheck.service_tls(
                ["python", "-m", container.module, *container.argv], container.env, command[3]
            )
            assert tls is not None and mounted(container, tls.ca, "the probe's --tls-ca") == "ca.crt"
            if container.config().security.tls_client_ca:
                assert mounted(container, tls.cert, "the probe's certificate") == f"{COMPONENT[container.module]}.crt"
                assert mounted(container, tls.key, "the probe's key") == f"{COMPONENT[container.module]}.key"


def test_the_coordinators_liveness_probe_asks_liveness_not_readiness():
    """Its readiness ("") turns NOT_SERVING while no target replica serves: a liveness probe
    asking it would restart every coordinator while the target pool is down."""
    for containers in (K8S_CONTAINERS, K8S_TLS_CONTAINERS):
        _, manifest, _ = containers["specdec-coordinator"]
        live, ready = manifest["livenessProbe"], manifest["readinessProbe"]
        if "grpc" in live:
            assert live["grpc"].get("service") == LIVENESS and "service" not in ready["grpc"]
        else:
            assert (
                live["exec"]["command"][-2:] == ["--service", LIVENESS] and "--service" not in ready["exec"]["command"]
            )


def without(mapping: dict, keys) -> dict:
    return {key: value for key, value in mapping.items() if key not in keys}


def test_k8s_tls_overlay_changes_only_settings_mounts_and_probes():
    """Everything else (ports, thresholds, placement) is the base's: the overlay cannot drift."""
    base, tls = k8s("Deployment"), k8s("Deployment", K8S_TLS)
    assert base.keys() == tls.keys()
    for name, (_, manifest, _) in K8S_TLS_CONTAINERS.items():
        [base_manifest] = [c for c in pod_spec(base[name])["containers"] if c["name"] == manifest["name"]]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert without(manifest[probe], ["exec"]) == without(base_manifest[probe], ["grpc"])
        changed = ("startupProbe", "readinessProbe", "livenessProbe", "volumeMounts")
        assert without(manifest, changed) == without(base_manifest, changed)
    assert {d["kind"] for d in K8S_TLS} == {d["kind"] for d in K8S}


def test_render_applies_json_patches_and_refuses_bad_ones(tmp_path):
    doc = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"list": [1, 2], "map": {"a": 1}}}
    render.apply_operation(doc, {"op": "add", "path": "/spec/list/-", "value": 3}, tmp_path)
    render.apply_operation(doc, {"op": "add", "path": "/spec/list/0", "value": 0}, tmp_path)
    render.apply_operation(doc, {"op": "remove", "path": "/spec/map/a"}, tmp_path)
    render.apply_operation(doc, {"op": "replace", "path": "/spec/list/1", "value": 9}, tmp_path)
    render.apply_operation(doc, {"op": "add", "path": "/spec/map/b~1c", "value": 2}, tmp_path)
    assert doc["spec"] == {"list": [0, 9, 2, 3], "map": {"b/c": 2}}
    for bad in (
        {"op": "test", "path": "/spec/list/0", "value": 5},
        {"op": "remove", "path": "/spec/map/zz"},
        {"op": "replace", "path": "/spec/list/4", "value": 1},
        {"op": "move", "path": "/spec", "from": "/x"},
    ):
        with pytest.raises(SystemExit):
            render.apply_operation(doc, bad, tmp_path)


# --- the health probe over TLS -------------------------------------------------------------


@pytest.fixture(params=["tls", "mutual tls"])
def tls_health_server(request, tls_files):
    mutual = request.param == "mutual tls"
    credentials = grpc.ssl_server_credentials(
        [(Path(tls_files.server_key).read_bytes(), Path(tls_files.server_cert).read_bytes())],
        Path(tls_files.ca).read_bytes() if mutual else None,
        require_client_auth=mutual,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield mutual, f"127.0.0.1:{port}"
    server.stop(None)


def test_health_probe_speaks_tls_and_mutual_tls(tls_health_server, tls_files):
    mutual, address = tls_health_server
    assert healthcheck.main([address]) == 1, "plaintext must not pass against a TLS server"
    assert healthcheck.main([address, "--tls-ca", tls_files.rogue_ca]) == 1, "a server another CA signed must not pass"
    assert healthcheck.main([address, "--tls-ca", tls_files.ca]) == (1 if mutual else 0)
    assert (
        healthcheck.main(
            [address, "--tls-ca", tls_files.ca, "--tls-cert", tls_files.server_cert, "--tls-key", tls_files.server_key]
        )
        == 0
    )


def test_health_probe_follows_the_services_tls_settings(tls_files):
    argv = ["python", "-m", "draft_service"]
    assert healthcheck.service_tls(argv, {}) is None
    env = {"SPECDEC_DRAFT_TLS_CERT": "/s/tls.crt", "SPECDEC_DRAFT_TLS_KEY": "/s/tls.key"}
    with pytest.raises(SystemExit, match="pass --tls-ca"):
        healthcheck.service_tls(argv, env)
    assert healthcheck.service_tls(argv, env, "/s/ca.crt") == healthcheck.ProbeTLS("/s/ca.crt")
    mutual = {**env, "SPECDEC_DRAFT_TLS_CLIENT_CA": "/s/ca.crt"}
    assert healthcheck.service_tls(argv, mutual) == healthcheck.ProbeTLS("/s/ca.crt", "/s/tls.crt", "/s/tls.key")
    assert healthcheck.service_tls([*argv, "--tls-cert", "/f/c.crt"], mutual).cert == "/f/c.crt", (
        "flags win over variables"
    )
    assert healthcheck.service_tls(argv, {"SPECDEC_DRAFT_TLS_CERT": ""}) is None, "an empty variable means unset"


# What a service's shutdown takes past --shutdown-grace: health's notice (serving.py), the
# coordinator's session ends (coordinator.server.CLEANUP_S), the trace flush (2 s), and a
# tensor-parallel target's workers' exits (10 s); then the runtime kills it.
SHUTDOWN_EXTRA_S = {"coordinator": 1 + 5 + 2, "draft_service": 1 + 2, "target_service": 1 + 2 + 10}


def prestop_pause_s(manifest: dict) -> float:
    command = manifest.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    match = re.search(r"time\.sleep\((\d+(?:\.\d+)?)\)", " ".join(command))
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("name", sorted(K8S_CONTAINERS))
def test_k8s_pods_pause_before_sigterm_and_get_their_whole_shutdown(name):
    """Endpoints drop a terminating pod on their own time: without a pause before SIGTERM, new
    calls met a server that had stopped accepting after its one-second notice. And the grace
    period must cover the shutdown, or the kill drops the sessions' ends (held till their TTL)."""
    container, manifest, deployment = K8S_CONTAINERS[name]
    pause = prestop_pause_s(manifest)
    needed = pause + container.config().shutdown_grace_s + SHUTDOWN_EXTRA_S[container.module]
    assert pause >= 5 and pod_spec(deployment)["terminationGracePeriodSeconds"] >= needed


@pytest.mark.parametrize("services", [COMPOSE, COMPOSE_POOLS], ids=["compose", "compose+pools"])
def test_compose_stop_grace_covers_each_services_shutdown(services):
    for name, container in compose_containers(services).items():
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s"), f"{name}: stop_grace_period in seconds, please"
        extra = SHUTDOWN_EXTRA_S[container.module] - (10 if container.module == "target_service" else 0)
        assert float(grace[:-1]) >= container.config().shutdown_grace_s + extra, name


def test_tensor_parallel_targets_get_room_in_dev_shm():
    """NCCL shares buffers through /dev/shm; a container's 64 MB default fails its start."""
    _, manifest, deployment = K8S_CONTAINERS["specdec-target"]
    volumes = {volume["name"]: volume for volume in pod_spec(deployment)["volumes"]}
    [shm] = [mount for mount in manifest["volumeMounts"] if mount["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    for services in (COMPOSE, COMPOSE_POOLS):
        for name, container in compose_containers(services).items():
            if container.module == "target_service":
                assert services[name]["shm_size"] == "1gb", name


def test_every_target_replica_has_a_kv_budget():
    """A replica without one counts as always having room (coordinator.replica.room), so a
    pool's overflow went to it: on a GPU, until it ran out of memory."""
    for services in (COMPOSE, COMPOSE_POOLS):
        for name, container in compose_containers(services).items():
            if container.module == "target_service":
                assert container.config().max_kv_bytes, name
    assert K8S_CONTAINERS["specdec-target"][0].config().max_kv_bytes
