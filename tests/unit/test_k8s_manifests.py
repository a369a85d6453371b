"""The Kubernetes example manifests agree with each other and with the command line."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from redsrv.cli import build_parser

yaml = pytest.importorskip("yaml")
K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"


def load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def redsrv_args(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("redsrv") + 1 :]


@pytest.fixture(scope="module")
def manifests() -> dict:  # type: ignore[type-arg]
    service, sts = load("reducers.yaml")
    (secret,) = load("secret.yaml")
    (job,) = load("pytorchjob.yaml")
    return {"service": service, "sts": sts, "secret": secret, "job": job}


def test_reducer_command_line_is_valid_and_matches_the_ports(manifests) -> None:  # type: ignore[no-untyped-def]
    container = manifests["sts"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(redsrv_args(container["args"][0]))
    assert args.command == "reducer" and args.require_secret and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"redsrv": args.port, "metrics": args.metrics_port}
    service_ports = {p["name"]: p["targetPort"] for p in manifests["service"]["spec"]["ports"]}
    assert service_ports == ports
    assert container["readinessProbe"]["httpGet"]["port"] == args.metrics_port


def test_workers_name_every_reducer_by_its_stable_dns_name(manifests) -> None:  # type: ignore[no-untyped-def]
    sts, service = manifests["sts"], manifests["service"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    master = manifests["job"]["spec"]["pytorchReplicaSpecs"]["Master"]
    env = {e["name"]: e["value"] for e in master["template"]["spec"]["containers"][0]["env"]}
    reducers = env["REDSRV_REDUCERS"].split(",")
    port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    expected = [f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{port}" for i in range(sts["spec"]["replicas"])]
    assert reducers == expected
    from redsrv import Config

    Config.from_env({k: v for k, v in env.items() if k != "REDSRV_SECRET_FILE"}, world_size=4, rank=0)  # valid config


def test_the_secret_is_mounted_where_both_sides_read_it(manifests) -> None:  # type: ignore[no-untyped-def]
    name = manifests["secret"]["metadata"]["name"]
    key = next(iter(manifests["secret"]["stringData"]))
    reducer_pod = manifests["sts"]["spec"]["template"]["spec"]
    worker_pod = manifests["job"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    for pod in (reducer_pod, worker_pod):
        assert pod["volumes"][0]["secret"]["secretName"] == name
        mount = pod["containers"][0]["volumeMounts"][0]["mountPath"]
        assert mount == "/etc/redsrv"
    reducer_args = build_parser().parse_args(redsrv_args(reducer_pod["containers"][0]["args"][0]))
    assert reducer_args.secret_file == f"/etc/redsrv/{key}"
    worker_env = {e["name"]: e["value"] for e in worker_pod["containers"][0]["env"]}
    assert worker_env["REDSRV_SECRET_FILE"] == f"/etc/redsrv/{key}"


def test_the_fleet_is_sized_by_the_bandwidth_rule(manifests) -> None:  # type: ignore[no-untyped-def]
    from redsrv.cli.plan import plan

    specs = manifests["job"]["spec"]["pytorchReplicaSpecs"]
    workers = sum(s["replicas"] for s in specs.values())
    worker_gbit = float(specs["Master"]["template"]["metadata"]["annotations"]["redsrv.io/nic-gbit"])
    reducer_gbit = float(manifests["sts"]["spec"]["template"]["metadata"]["annotations"]["redsrv.io/nic-gbit"])
    replicas = manifests["sts"]["spec"]["replicas"]
    cores = int(manifests["sts"]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])
    assert replicas * reducer_gbit >= workers * worker_gbit
    recommended = plan(workers=workers, worker_gbit=worker_gbit, reducer_gbit=reducer_gbit, reducer_cores=cores)
    assert recommended.reducers <= replicas
    # At 25 Gbit/s a worker's single I/O thread, not the network, is the limit (redsrv plan says so);
    # nothing else may be wrong with the manifest's sizing.
    assert [w for w in recommended.warnings if "I/O thread" not in w] == [], recommended.warnings
