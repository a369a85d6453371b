"""The Kubernetes example manifests agree with each other, with the command line, with `redsrv
plan` and with the image; pods meet Pod Security "restricted" and the fleet survives a drain. The
fleet is checked as the base file and as each Kustomize overlay renders it (kubectl kustomize)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from redsrv.cli import build_parser

yaml = pytest.importorskip("yaml")
K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"
JOBS = {"pytorchjob.yaml": "pytorchReplicaSpecs", "tfjob.yaml": "tfReplicaSpecs", "jaxjob.yaml": "jaxReplicaSpecs"}
FLEETS = ["base/reducers.yaml", "overlays/25g", "overlays/100g"]


def load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def fleet_documents(source: str) -> list[dict]:  # type: ignore[type-arg]
    if source.endswith(".yaml"):
        return load(source)
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip(f"kubectl is not installed: {source} is not rendered (apt-get install kubectl)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / source)], capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def reducer_args(manifests: dict):  # type: ignore[no-untyped-def,type-arg]
    container = manifests["sts"]["spec"]["template"]["spec"]["containers"][0]
    return build_parser().parse_args(container["args"])  # the image's ENTRYPOINT is `redsrv`


def job_pods(manifests: dict) -> list[dict]:  # type: ignore[type-arg]
    return [spec["template"] for name, key in JOBS.items() for spec in manifests["jobs"][name]["spec"][key].values()]


def worker_env(manifests: dict, pod: dict | None = None) -> dict[str, str]:  # type: ignore[type-arg]
    """What a worker's container sees from the manifests: the fleet's ConfigMap (envFrom), then its env."""
    container = (pod or job_pods(manifests)[0])["spec"]["containers"][0]
    (source,) = container["envFrom"]
    assert source == {"configMapRef": {"name": manifests["fleet"]["metadata"]["name"]}}
    return {**manifests["fleet"]["data"], **{e["name"]: e["value"] for e in container["env"]}}


def pods(manifests: dict) -> list[dict]:  # type: ignore[type-arg]
    return [manifests["sts"]["spec"]["template"], *job_pods(manifests)]


@pytest.fixture(scope="module", params=FLEETS)
def manifests(request) -> dict:  # type: ignore[no-untyped-def,type-arg]
    by_kind = {}
    for doc in fleet_documents(request.param):
        by_kind[(doc["kind"], doc["metadata"]["name"])] = doc
    (secret,) = load("secret.yaml")
    return {"source": request.param, "fleet": by_kind[("ConfigMap", "redsrv-fleet")],
            "service": by_kind[("Service", "redsrv-reducers")], "sts": by_kind[("StatefulSet", "redsrv-reducer")],
            "pdb": by_kind[("PodDisruptionBudget", "redsrv-reducer")], "policy": by_kind[("NetworkPolicy", "redsrv-reducer")],
            "worker_policy": by_kind[("NetworkPolicy", "redsrv-workers")], "secret": secret,
            "jobs": {name: load(name)[0] for name in JOBS}}


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
    args = reducer_args(manifests)
    ports = f"{args.port}-{args.port + args.processes - 1}" if args.processes > 1 else str(args.port)
    expected = [f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{ports}" for i in range(sts["spec"]["replicas"])]
    from redsrv import Config

    for pod in job_pods(manifests):
        env = worker_env(manifests, pod)
        assert env["REDSRV_REDUCERS"].split(",") == expected
        Config.from_env({k: v for k, v in env.items() if k != "REDSRV_SECRET_FILE"}, world_size=4, rank=0)  # valid config


def test_the_secret_is_mounted_where_both_sides_read_it(manifests) -> None:  # type: ignore[no-untyped-def]
    name = manifests["secret"]["metadata"]["name"]
    key = next(iter(manifests["secret"]["stringData"]))
    for pod in pods(manifests):
        assert pod["spec"]["volumes"][0]["secret"]["secretName"] == name
        mount = pod["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
        assert mount == "/etc/redsrv"
    assert reducer_args(manifests).secret_file == f"/etc/redsrv/{key}"
    for pod in job_pods(manifests):
        assert worker_env(manifests, pod)["REDSRV_SECRET_FILE"] == f"/etc/redsrv/{key}"


def test_the_fleet_is_what_redsrv_plan_recommends(manifests) -> None:  # type: ignore[no-untyped-def]
    """Each fleet names the `redsrv plan` command it follows (the ConfigMap's redsrv.io/plan); its
    reducer count, NIC, cores, --processes and the workers' REDSRV_IO_THREADS are what that recommends."""
    from redsrv.cli.plan import plan

    asked = build_parser().parse_args(["plan", *shlex.split(manifests["fleet"]["metadata"]["annotations"]["redsrv.io/plan"])])
    sts = manifests["sts"]
    template = sts["spec"]["template"]
    cores = int(template["spec"]["containers"][0]["resources"]["requests"]["cpu"])
    assert float(template["metadata"]["annotations"]["redsrv.io/nic-gbit"]) == asked.reducer_gbit
    assert cores == asked.reducer_cores
    recommended = plan(workers=asked.workers, worker_gbit=asked.worker_gbit, reducer_gbit=asked.reducer_gbit,
                       reducer_cores=cores, workers_per_host=asked.workers_per_host)
    assert sts["spec"]["replicas"] == recommended.reducers
    assert sts["spec"]["replicas"] * asked.reducer_gbit >= asked.workers * asked.worker_gbit
    assert reducer_args(manifests).processes == recommended.reducer_processes
    assert int(manifests["fleet"]["data"]["REDSRV_IO_THREADS"]) == recommended.worker_io_threads
    assert not recommended.warnings, recommended.warnings


def test_the_job_examples_are_the_workers_the_base_fleet_is_sized_for() -> None:
    (fleet,) = [d for d in load("base/reducers.yaml") if d["kind"] == "ConfigMap"]
    asked = build_parser().parse_args(["plan", *shlex.split(fleet["metadata"]["annotations"]["redsrv.io/plan"])])
    for name, key in JOBS.items():
        specs = load(name)[0]["spec"][key]
        assert sum(s["replicas"] for s in specs.values()) == asked.workers * asked.workers_per_host, name
        for spec in specs.values():
            assert float(spec["template"]["metadata"]["annotations"]["redsrv.io/nic-gbit"]) == asked.worker_gbit, name


def test_the_jaxjob_passes_the_operators_rank_and_size_to_the_example() -> None:
    """The JAXJob operator sets PROCESS_ID and NUM_PROCESSES; Kubernetes expands $(NAME) in args."""
    (job,) = load("jaxjob.yaml")
    container = job["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "jax" and container["command"][-1] == "redsrv.examples.jax_optax"
    args = container["args"]
    assert args[args.index("--rank") + 1] == "$(PROCESS_ID)" and args[args.index("--world-size") + 1] == "$(NUM_PROCESSES)"
    (tf,) = load("tfjob.yaml")
    assert {s["template"]["spec"]["containers"][0]["name"] for s in tf["spec"]["tfReplicaSpecs"].values()} == {"tensorflow"}


def test_pods_meet_pod_security_restricted_and_start_with_nothing_to_install(manifests) -> None:  # type: ignore[no-untyped-def]
    for template in pods(manifests):
        pod = template["spec"]
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
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
    for pod in job_pods(manifests):
        assert rules[data] == [{"podSelector": {"matchLabels": pod["metadata"]["labels"]}}]
        # ... and the training pods only from each other
        workers = manifests["worker_policy"]["spec"]
        assert workers["podSelector"]["matchLabels"] == pod["metadata"]["labels"]
        assert workers["ingress"] == [{"from": [{"podSelector": {"matchLabels": pod["metadata"]["labels"]}}]}]
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
    # The compiled plane is built in the build stage, which fails rather than fall back without it.
    assert "COPY native native" in lines and "ENV REDSRV_NATIVE_STRICT=1" in lines


def test_the_readme_creates_the_secret_rather_than_applying_the_placeholder() -> None:
    readme = (K8S / "README.md").read_text()
    assert "kubectl create secret generic redsrv-secret" in readme
    assert "apply -f secret.yaml" not in readme
