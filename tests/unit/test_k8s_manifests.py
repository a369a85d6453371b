"""The Kubernetes example manifests agree with each other, with the command line, with `redsrv
plan` and with the image; pods meet Pod Security "restricted" and the fleet survives a drain."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from redsrv.cli import build_parser

yaml = pytest.importorskip("yaml")
K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"


def load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def reducer_args(manifests: dict):  # type: ignore[no-untyped-def,type-arg]
    container = manifests["sts"]["spec"]["template"]["spec"]["containers"][0]
    return build_parser().parse_args(container["args"])  # the image's ENTRYPOINT is `redsrv`


def worker_env(manifests: dict) -> dict[str, str]:  # type: ignore[type-arg]
    master = manifests["job"]["spec"]["pytorchReplicaSpecs"]["Master"]
    return {e["name"]: e["value"] for e in master["template"]["spec"]["containers"][0]["env"]}


def pods(manifests: dict) -> list[dict]:  # type: ignore[type-arg]
    return [manifests["sts"]["spec"]["template"]] + [spec["template"] for spec in
                                                      manifests["job"]["spec"]["pytorchReplicaSpecs"].values()]


@pytest.fixture(scope="module")
def manifests() -> dict:  # type: ignore[type-arg]
    service, sts, pdb, policy = load("reducers.yaml")
    (secret,) = load("secret.yaml")
    (job,) = load("pytorchjob.yaml")
    return {"service": service, "sts": sts, "pdb": pdb, "policy": policy, "secret": secret, "job": job}


def test_reducer_command_line_is_valid_and_matches_the_ports(manifests) -> None:  # type: ignore[no-untyped-def]
    container = manifests["sts"]["spec"]["template"]["spec"]["containers"][0]
    args = reducer_args(manifests)
    assert args.command == "reducer" and args.require_secret and args.host == "0.0.0.0"
    # --processes p: the data ports PORT..PORT+p-1 and the metrics ports likewise (cli/processes.py)
    expected = {args.port + i for i in range(args.processes)} | {args.metrics_port + i for i in range(args.processes)}
    assert {p["containerPort"] for p in container["ports"]} == expected
    assert {p["targetPort"] for p in manifests["service"]["spec"]["ports"]} == expected
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == args.metrics_port, probe


def test_workers_name_every_reducer_by_its_stable_dns_name(manifests) -> None:  # type: ignore[no-untyped-def]
    sts, service = manifests["sts"], manifests["service"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    env = worker_env(manifests)
    reducers = env["REDSRV_REDUCERS"].split(",")
    args = reducer_args(manifests)
    ports = f"{args.port}-{args.port + args.processes - 1}" if args.processes > 1 else str(args.port)
    expected = [f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{ports}" for i in range(sts["spec"]["replicas"])]
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
    assert reducer_args(manifests).secret_file == f"/etc/redsrv/{key}"
    assert worker_env(manifests)["REDSRV_SECRET_FILE"] == f"/etc/redsrv/{key}"


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
    # What `redsrv plan --workers 4 --worker-gbit 25 --reducer-gbit 25` recommends beside the count.
    assert reducer_args(manifests).processes == recommended.reducer_processes
    assert int(worker_env(manifests).get("REDSRV_IO_THREADS", "1")) == recommended.worker_io_threads
    assert not recommended.warnings, recommended.warnings


def test_pods_meet_pod_security_restricted_and_start_with_nothing_to_install(manifests) -> None:  # type: ignore[no-untyped-def]
    for template in pods(manifests):
        pod = template["spec"]
        assert pod["enableServiceLinks"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True
            words = " ".join(shlex.join(container.get(k, [])) for k in ("command", "args"))
            assert "pip" not in words.split() and container["image"].startswith("redsrv"), container["image"]


def test_reducers_spread_one_per_node_and_a_drain_takes_one_at_a_time(manifests) -> None:  # type: ignore[no-untyped-def]
    pod = manifests["sts"]["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == pod["metadata"]["labels"]
    pdb = manifests["pdb"]
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]


def test_only_workers_reach_the_data_ports_and_only_monitoring_the_metrics(manifests) -> None:  # type: ignore[no-untyped-def]
    policy, args = manifests["policy"], reducer_args(manifests)
    assert policy["spec"]["podSelector"]["matchLabels"] == manifests["sts"]["spec"]["template"]["metadata"]["labels"]
    rules = {tuple(sorted(p["port"] for p in rule["ports"])): rule["from"] for rule in policy["spec"]["ingress"]}
    data = tuple(args.port + i for i in range(args.processes))
    metrics = tuple(args.metrics_port + i for i in range(args.processes))
    assert set(rules) == {data, metrics}
    worker_labels = manifests["job"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    assert rules[data] == [{"podSelector": {"matchLabels": worker_labels}}]
    assert "namespaceSelector" in rules[metrics][0]


def test_the_image_is_multi_stage_non_root_and_runs_redsrv(manifests) -> None:  # type: ignore[no-untyped-def]
    dockerfile = (K8S.parents[1] / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert sum(line.startswith("FROM ") for line in lines) == 2  # a build stage, and a runtime without the sources
    user = next(line.split()[1] for line in lines if line.startswith("USER "))
    assert user.isdigit() and int(user) != 0  # numeric: runAsNonRoot can check it
    assert 'ENTRYPOINT ["redsrv"]' in lines
    assert {template["spec"]["securityContext"]["runAsUser"] for template in pods(manifests)} == {int(user)}
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile  # never the CUDA wheels by default


def test_the_readme_creates_the_secret_rather_than_applying_the_placeholder() -> None:
    readme = (K8S / "README.md").read_text()
    assert "kubectl create secret generic redsrv-secret" in readme
    assert "apply -f secret.yaml" not in readme
