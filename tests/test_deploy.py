"""Offline validation of the deployment: Dockerfile, k8s/ manifests and their kustomize overlays.

Nothing here needs a cluster or a Docker engine (docs/design.md §11, issue 6):
- every YAML file under k8s/ parses;
- core kinds (PersistentVolumeClaim, batch/v1 Job) validate strictly (unknown fields rejected) with
  kubernetes-validate against the Kubernetes versions in ``KUBERNETES_VERSIONS``;
- KubeRay kinds (RayJob, RayCluster) validate against the openAPIV3Schema of the KubeRay CRDs, made
  strict by ``forbid_unknown_fields``; their metadata validates strictly as ObjectMeta and every pod
  template they embed strictly as a core PodTemplate;
- cross-checks: GPUs per run == the referenced config's world_size, the config file exists, one image
  tag everywhere (manifests, overlays, Dockerfile label), Ray version, user id and working directory
  match the Dockerfile, multicast-off environment and /dev/shm on every GPU pod, results on the PVC;
- security: Ray token authentication on every Ray cluster (KubeRay ``authOptions``, or RAY_AUTH_MODE /
  RAY_AUTH_TOKEN from a Secret through k8s/components/token-secret for older operators; never
  ``disabled``), a NetworkPolicy per workload that admits the Ray ports from this namespace only (the
  KubeRay operator's job-API polling excepted), no service-account token, read-only root file systems
  with emptyDirs for /tmp, Ray's session dir and the image user's HOME;
- N nodes x 8 GPUs (overlays using k8s/components/multinode): the overlay's local-config settings (node
  count, run config) reach every worker group and the RayJob's command; one worker pod per node (required
  anti-affinity on the host name) with 8 GPUs, the RDMA devices, IPC_LOCK as the only added capability,
  /dev/shm for the object store and NCCL/NVSHMEM, the InfiniBand environment with multicast off, a
  preferred topology affinity, and a NetworkPolicy letting the workload's pods reach each other on every
  port; the image installs the verbs libraries;
- `kubectl kustomize` renders every overlay (and the base with the token-secret component) and the
  rendered objects pass the same checks;
- hadolint passes on the Dockerfile with no finding at any level.
Each validator also has a test showing it rejects a bad input, so none of them can pass vacuously.

KubeRay CRDs are data kept outside the repository (../shared/k8s/crds beside the checkout). Policy:
``FLASHDMOE_CRD_DIR`` unset -> use that default; set to a path -> use it; set to the empty string ->
the CRD-schema tests are skipped (an explicit opt-out). A CRD directory that was asked for (by default
or by path) but is missing or incomplete FAILS the CRD tests with a message saying where it looked.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

try:  # Python >= 3.11; pyproject allows 3.10, where only the version cross-check is skipped.
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the interpreter
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "k8s"
BASE_DIR = K8S_DIR / "base"
OVERLAYS_DIR = K8S_DIR / "overlays"
DOCKERFILE = REPO / "Dockerfile"

# A floor most managed clusters still run, and the newest schema kubernetes-validate ships: a field
# that exists in only one of them fails.
KUBERNETES_VERSIONS = ("1.33", kubernetes_validate.utils.latest_version())

CRD_DIR_ENV = "FLASHDMOE_CRD_DIR"
DEFAULT_CRD_DIR = REPO.parent / "shared" / "k8s" / "crds"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}

GPU_RESOURCE = "nvidia.com/gpu"
IMAGE_NAME = "flashdmoe"
RESULTS_MOUNT = "/results"
COMPONENT_LABEL = "app.kubernetes.io/component"
CONFIG_ANNOTATION = "flashdmoe.io/config"
MULTICAST_OFF_ENV = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
WORKLOAD_KINDS = ("RayJob", "RayCluster", "Job")
COMPONENTS_DIR = K8S_DIR / "components"
TOKEN_SECRET_COMPONENT = COMPONENTS_DIR / "token-secret"
#: Ray's session directory (``ray start`` / ``ray.init`` default temp dir).
RAY_SESSION_DIR = "/tmp/ray"
#: GCS, dashboard / job API, Ray Client server: what pods of the namespace may reach.
RAY_CLIENT_PORTS = {6379, 8265, 10001}
#: The KubeRay operator polls a RayJob's job API from its own namespace.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
OPERATOR_PORTS = {8265}

#: N nodes x 8 GPUs (k8s/components/multinode): overlays using it hold their node count and run config
#: in a local-config ConfigMap of this name.
MULTINODE_COMPONENT = COMPONENTS_DIR / "multinode"
MULTINODE_SETTINGS = "flashdmoe-multinode-run"
GPUS_PER_NODE = 8
#: The RDMA shared device plugin's resource (NVIDIA Network Operator's default naming).
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
HOSTNAME_KEY = "kubernetes.io/hostname"
#: The GPU workers' environment across nodes: multicast off, NVSHMEM's IB RC transport (IBGDA off), the
#: unique-id bootstrap and NCCL's / gloo's sockets on the pod network, NCCL's InfiniBand on.
MULTINODE_ENV = {
    **MULTICAST_OFF_ENV,
    "FLASHDMOE_KERNEL_BUILD": "nvshmem",
    "NVSHMEM_REMOTE_TRANSPORT": "ibrc",
    "NVSHMEM_IB_ENABLE_IBGDA": "0",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY": "AF_INET",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
}
#: Set, but to the cluster's own HCA names (a placeholder value that must not be empty).
MULTINODE_ENV_SET = ("NCCL_IB_HCA",)
#: /dev/shm beyond Ray's object store, per GPU process: NCCL's and NVSHMEM's host-side segments.
SHM_HEADROOM_PER_GPU = 1 << 30
#: The RDMA user space NVSHMEM's and NCCL's InfiniBand transports load (libibverbs and its mlx5 provider).
RDMA_PACKAGES = ("libibverbs1", "ibverbs-providers")


# --------------------------------------------------------------------------------------------------
# Loading and rendering


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a file, parsed with yaml.safe_load_all."""
    with path.open() as handle:
        return [document for document in yaml.safe_load_all(handle) if document is not None]


def base_manifest_files() -> list[Path]:
    """The resource files of the kustomize base (its kustomization.yaml excluded)."""
    return sorted(path for path in BASE_DIR.glob("*.yaml") if path.name != "kustomization.yaml")


def overlay_dirs() -> list[Path]:
    return sorted(path.parent for path in OVERLAYS_DIR.glob("*/kustomization.yaml"))


def kustomization(directory: Path) -> dict[str, Any]:
    return load_yaml_documents(directory / "kustomization.yaml")[0]


def is_multinode(directory: Path) -> bool:
    """Whether a kustomization directory uses k8s/components/multinode."""
    return any((directory / component).resolve() == MULTINODE_COMPONENT.resolve()
               for component in kustomization(directory).get("components", []))


def multinode_overlay_dirs() -> list[Path]:
    return [directory for directory in overlay_dirs() if is_multinode(directory)]


def multinode_settings(directory: Path) -> dict[str, str]:
    """The data of a multi-node overlay's local-config ConfigMap (its node count and run config)."""
    found = [document for resource in kustomization(directory).get("resources", [])
             if (directory / resource).is_file()
             for document in load_yaml_documents(directory / resource)
             if document.get("kind") == "ConfigMap" and document["metadata"]["name"] == MULTINODE_SETTINGS]
    assert len(found) == 1, f"{directory}: expected one ConfigMap {MULTINODE_SETTINGS} among its resources"
    (settings,) = found
    annotations = settings["metadata"].get("annotations", {})
    assert annotations.get("config.kubernetes.io/local-config") == "true", (
        f"{directory}: {MULTINODE_SETTINGS} must be local-config (read by kustomize, not applied)")
    return settings["data"]


def workloads_of(directory: Path | None) -> set[str]:
    """The workload components a manifest set holds: all three, the plain Job aside across nodes."""
    if directory is not None and is_multinode(directory):
        return {"rayjob", "raycluster"}
    return {"rayjob", "raycluster", "job"}


def set_directory(set_id: str) -> Path | None:
    return OVERLAYS_DIR / set_id.removeprefix("overlay-") if set_id.startswith("overlay-") else None


def require_tool(name: str) -> str:
    """Path of a command-line tool the tests need; a missing one is a failure, not a skip."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH; it is a test dependency (see pyproject.toml test extras)")
    return path


def kustomize_build(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("kubectl"), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@functools.lru_cache(maxsize=None)
def _rendered_cached(directory: str) -> tuple[dict[str, Any], ...]:
    result = kustomize_build(Path(directory))
    if result.returncode != 0:
        raise AssertionError(f"`kubectl kustomize {directory}` failed:\n{result.stderr}")
    return tuple(document for document in yaml.safe_load_all(result.stdout) if document is not None)


def rendered(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize DIR` renders (a fresh deep copy each call)."""
    return copy.deepcopy(list(_rendered_cached(str(directory))))


MANIFEST_SET_IDS = ["base-files", "base-rendered"] + [f"overlay-{path.name}" for path in overlay_dirs()]


def load_manifest_set(set_id: str) -> list[dict[str, Any]]:
    """The objects of one manifest set: the base files as written, or a directory as kustomize renders it."""
    if set_id == "base-files":
        return [obj for path in base_manifest_files() for obj in load_yaml_documents(path)]
    if set_id == "base-rendered":
        return rendered(BASE_DIR)
    return rendered(OVERLAYS_DIR / set_id.removeprefix("overlay-"))


@pytest.fixture(params=MANIFEST_SET_IDS)
def manifest_set(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(set id, objects) for every manifest set: each test runs on the base and on every overlay."""
    return request.param, load_manifest_set(request.param)


def object_name(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


# --------------------------------------------------------------------------------------------------
# Pod templates inside the workloads


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any], int, bool]]:
    """The pod templates a workload runs, as (role, template, pod count, runs the driver).

    role names the template in messages; pod count is how many pods run from it (replicas x hosts);
    the driver (`flashdmoe run`) runs in the Ray head (RayJob, RayCluster) or the Job's pod.
    """
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind == "Job":
        return [("pod", spec["template"], 1, True)]
    if kind not in ("RayJob", "RayCluster"):
        return []
    cluster = spec["rayClusterSpec"] if kind == "RayJob" else spec
    templates = [("head", cluster["headGroupSpec"]["template"], 1, True)]
    for group in cluster.get("workerGroupSpecs", []):
        pods = group.get("replicas", group.get("minReplicas", 0)) * group.get("numOfHosts", 1)
        templates.append((f"worker group {group['groupName']}", group["template"], pods, False))
    if kind == "RayJob" and "submitterPodTemplate" in spec:
        templates.append(("submitter", spec["submitterPodTemplate"], 1, False))
    return templates


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    pod_spec = template.get("spec", {})
    return pod_spec.get("initContainers", []) + pod_spec.get("containers", [])


def gpus_of_pod(template: dict[str, Any]) -> int:
    """GPUs one pod of this template requests (sum over its main containers' limits)."""
    return sum(
        int(container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE, 0))
        for container in template.get("spec", {}).get("containers", [])
    )


def as_pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    """Wrap a PodTemplateSpec in a core v1 PodTemplate so kubernetes-validate checks it strictly."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def as_object_meta_carrier(metadata: dict[str, Any]) -> dict[str, Any]:
    """Wrap ObjectMeta in a ConfigMap (no other required fields) to validate the metadata strictly."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}


# --------------------------------------------------------------------------------------------------
# Validators


def validate_core(obj: dict[str, Any], version: str) -> None:
    """Strict kubernetes-validate of a core object; raises kubernetes_validate.ValidationError."""
    kubernetes_validate.validate(obj, version, strict=True)


def forbid_unknown_fields(schema: Any) -> Any:
    """Copy of a CRD OpenAPI v3 schema in which unknown fields are errors.

    CRD schemas leave objects open (the API server prunes unknown fields instead of rejecting them),
    so every object schema that lists ``properties`` gets ``additionalProperties: false`` unless it
    opts out with ``x-kubernetes-preserve-unknown-fields`` or already says what extra keys may be.
    """
    if isinstance(schema, list):
        return [forbid_unknown_fields(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {}
    for key, value in schema.items():
        if key == "properties":
            strict[key] = {name: forbid_unknown_fields(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            strict[key] = forbid_unknown_fields(value)
        else:
            strict[key] = value
    if (
        "properties" in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields", False)
        and "additionalProperties" not in schema
    ):
        strict["additionalProperties"] = False
    return strict


def crd_schema(crd: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    """The openAPIV3Schema of one served version of a CustomResourceDefinition."""
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return served["schema"]["openAPIV3Schema"]
    raise AssertionError(f"CRD {crd['metadata']['name']} has no version {version!r}")


def schema_errors(validator: jsonschema.protocols.Validator, obj: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda error: list(map(str, error.path)))
    ]


def crd_directory() -> Path | None:
    """The CRD directory by the policy in the module docstring; None means explicitly opted out."""
    configured = os.environ.get(CRD_DIR_ENV)
    if configured == "":
        return None
    directory = Path(configured) if configured is not None else DEFAULT_CRD_DIR
    missing = [name for name in CRD_FILES.values() if not (directory / name).is_file()]
    if missing:
        source = f"{CRD_DIR_ENV}={configured}" if configured is not None else f"default (unset {CRD_DIR_ENV})"
        pytest.fail(
            f"KubeRay CRDs not found: {', '.join(missing)} missing in {directory} ({source}). "
            f"Put the KubeRay CRDs there, point {CRD_DIR_ENV} at them, or set {CRD_DIR_ENV}='' to "
            "skip the CRD-schema checks deliberately."
        )
    return directory


@functools.lru_cache(maxsize=None)
def _load_crd(path: str) -> dict[str, Any]:
    # The CRDs are ~40k lines: libyaml's loader when PyYAML has it (about 4x faster), same result.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as handle:
        crd = yaml.load(handle, Loader=loader)
    return crd


def crd_validator(path: Path, kind: str, strict: bool = True) -> jsonschema.protocols.Validator:
    """A jsonschema validator for one CRD file's v1 schema, strict (unknown fields rejected) or as shipped."""
    crd = _load_crd(str(path))
    assert crd["spec"]["names"]["kind"] == kind, f"{path} defines {crd['spec']['names']['kind']}, not {kind}"
    schema = crd_schema(crd)
    return jsonschema.Draft7Validator(forbid_unknown_fields(schema) if strict else schema)


@pytest.fixture(scope="session")
def crd_validators() -> dict[str, jsonschema.protocols.Validator]:
    """Strict jsonschema validators for RayJob and RayCluster, keyed by kind."""
    directory = crd_directory()
    if directory is None:
        pytest.skip(f"{CRD_DIR_ENV} is set to '': KubeRay CRD-schema validation skipped on request")
    return {kind: crd_validator(directory / name, kind) for kind, name in CRD_FILES.items()}


@pytest.fixture(scope="session")
def raw_crd_validators(crd_validators) -> dict[str, jsonschema.protocols.Validator]:
    """The CRD schemas exactly as shipped (no strictness added), for the negative tests."""
    directory = crd_directory()
    return {kind: crd_validator(directory / name, kind, strict=False) for kind, name in CRD_FILES.items()}


def validate_custom_resource(
    obj: dict[str, Any], validators: dict[str, jsonschema.protocols.Validator]
) -> list[str]:
    """Errors of a RayJob/RayCluster against its strict CRD schema (empty list when valid)."""
    return [f"{object_name(obj)}: {message}" for message in schema_errors(validators[obj["kind"]], obj)]


# --------------------------------------------------------------------------------------------------
# Dockerfile facts the manifests must agree with


@functools.lru_cache(maxsize=None)
def dockerfile_facts() -> dict[str, str]:
    """Image version label, pinned Ray version, numeric user id, working directory and ENV names."""
    text = DOCKERFILE.read_text()
    # Join continuation lines so multi-line instructions read as one.
    joined = re.sub(r"\\\n", " ", text)

    def single(pattern: str, what: str) -> str:
        matches = re.findall(pattern, joined, flags=re.MULTILINE)
        assert len(matches) == 1, f"Dockerfile: expected one {what}, found {matches}"
        return matches[0]

    return {
        "version": single(r'org\.opencontainers\.image\.version="([^"]+)"', "image version label"),
        "ray": single(r"ray\[default\]==([0-9][^\s\"']*)", "ray[default]==<version> pin"),
        "user": single(r"^USER\s+(\d+)(?::\d+)?\s*$", "numeric USER"),
        "workdir": single(r"^WORKDIR\s+(\S+)\s*$", "WORKDIR"),
        "home": single(r"\buseradd\b[^\n]*--home-dir\s+(\S+)", "useradd --home-dir"),
        "env": " ".join(re.findall(r"^ENV\s+(.*)$", joined, flags=re.MULTILINE)),
    }


def image_reference(image: str) -> tuple[str, str | None]:
    """(name, tag) of an image reference; tag None when it has none (a registry port is no tag)."""
    if ":" in image.rsplit("/", 1)[-1]:
        name, tag = image.rsplit(":", 1)
        return name, tag
    return image, None


# --------------------------------------------------------------------------------------------------
# Cross-checks: each returns a list of problems (empty when consistent) so negative tests can see them


def read_world_size(config_path: str) -> int | None:
    """world_size of a repo config file (MoEConfig's default 1 when absent); None if no such file."""
    path = REPO / config_path
    if not path.is_file():
        return None
    with path.open() as handle:
        config = yaml.safe_load(handle)
    return int(config.get("world_size", 1))


def command_config(obj: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The --config of the command a workload runs (None for a RayCluster) and that command's argv."""
    if obj["kind"] == "RayJob":
        argv = shlex.split(obj["spec"]["entrypoint"])
    elif obj["kind"] == "Job":
        container = obj["spec"]["template"]["spec"]["containers"][0]
        argv = list(container.get("command", [])) + list(container.get("args", []))
    else:
        return None, []
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return None, argv
    return argv[argv.index("--config") + 1], argv


def check_gpus_match_config(objects: list[dict[str, Any]]) -> list[str]:
    """GPUs per run == world_size of the config each workload runs; the config file exists."""
    problems = []
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        name = object_name(obj)
        annotated = obj["metadata"].get("annotations", {}).get(CONFIG_ANNOTATION)
        commanded, argv = command_config(obj)
        if obj["kind"] != "RayCluster":
            if commanded is None:
                problems.append(f"{name}: command {argv} has no --config FILE")
                continue
            if argv[:2] != ["flashdmoe", "run"]:
                problems.append(f"{name}: command {argv} does not start with `flashdmoe run`")
            if annotated != commanded:
                problems.append(f"{name}: annotation {CONFIG_ANNOTATION}={annotated} but --config {commanded}")
        config = commanded or annotated
        if config is None:
            problems.append(f"{name}: no {CONFIG_ANNOTATION} annotation naming the config it is sized for")
            continue
        world_size = read_world_size(config)
        if world_size is None:
            problems.append(f"{name}: config {config} does not exist in the repository")
            continue
        total_gpus = 0
        for role, template, pods, runs_driver in pod_templates(obj):
            total_gpus += pods * gpus_of_pod(template)
            if runs_driver and obj["kind"] != "Job" and gpus_of_pod(template) != 0:
                problems.append(f"{name}: the Ray head must be CPU-only, it requests {gpus_of_pod(template)} GPUs")
            for container in containers(template):
                resources = container.get("resources", {})
                requested = resources.get("requests", {}).get(GPU_RESOURCE)
                limited = resources.get("limits", {}).get(GPU_RESOURCE)
                if requested is not None and requested != limited:
                    problems.append(f"{name} {role}: GPU request {requested} != limit {limited}")
        if total_gpus != world_size:
            problems.append(f"{name}: requests {total_gpus} GPUs but {config} has world_size {world_size}")
    return problems


def check_images(objects: list[dict[str, Any]], expected_tag: str) -> list[str]:
    """Every container runs [registry/]IMAGE_NAME:expected_tag (an overlay may set a registry)."""
    problems = []
    for obj in objects:
        for role, template, _, _ in pod_templates(obj):
            for container in containers(template):
                name, tag = image_reference(container.get("image", ""))
                if (name.rsplit("/", 1)[-1], tag) != (IMAGE_NAME, expected_tag):
                    problems.append(
                        f"{object_name(obj)} {role} container {container['name']}: image "
                        f"{container.get('image')!r}, expected {IMAGE_NAME}:{expected_tag}"
                    )
    return problems


def check_pods_match_image(objects: list[dict[str, Any]]) -> list[str]:
    """Pods run as the image's non-root user, in its working directory; Ray version == the image's."""
    facts = dockerfile_facts()
    problems = []
    for obj in objects:
        if obj["kind"] == "RayJob":
            ray_version = obj["spec"]["rayClusterSpec"].get("rayVersion")
        elif obj["kind"] == "RayCluster":
            ray_version = obj["spec"].get("rayVersion")
        else:
            ray_version = facts["ray"]
        if ray_version != facts["ray"]:
            problems.append(f"{object_name(obj)}: rayVersion {ray_version!r}, the image has Ray {facts['ray']}")
        for role, template, _, _ in pod_templates(obj):
            security = template["spec"].get("securityContext", {})
            if security.get("runAsNonRoot") is not True or str(security.get("runAsUser")) != facts["user"]:
                problems.append(
                    f"{object_name(obj)} {role}: securityContext {security} must set runAsNonRoot: true "
                    f"and runAsUser: {facts['user']} (the Dockerfile's USER)"
                )
            for container in containers(template):
                if container.get("workingDir") != facts["workdir"]:
                    problems.append(
                        f"{object_name(obj)} {role} container {container['name']}: workingDir "
                        f"{container.get('workingDir')!r}, expected {facts['workdir']} (relative "
                        "config paths resolve there)"
                    )
    return problems


def check_gpu_pods(objects: list[dict[str, Any]]) -> list[str]:
    """GPU pods: multicast-off env, /dev/shm as a memory emptyDir; driver pods: results PVC mounted."""
    claim_names = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "PersistentVolumeClaim"}
    problems = []
    for obj in objects:
        for role, template, _, runs_driver in pod_templates(obj):
            where = f"{object_name(obj)} {role}"
            volumes = {volume["name"]: volume for volume in template["spec"].get("volumes", [])}
            mounts = {
                mount["mountPath"]: mount["name"]
                for container in template["spec"]["containers"]
                for mount in container.get("volumeMounts", [])
            }
            if gpus_of_pod(template) > 0:
                for container in template["spec"]["containers"]:
                    env = {item["name"]: item.get("value") for item in container.get("env", [])}
                    for variable, value in MULTICAST_OFF_ENV.items():
                        if env.get(variable) != value:
                            problems.append(f"{where}: {variable} is {env.get(variable)!r}, expected {value!r}")
                shm = volumes.get(mounts.get("/dev/shm", ""), {})
                if shm.get("emptyDir", {}).get("medium") != "Memory":
                    problems.append(f"{where}: /dev/shm must be an emptyDir with medium Memory, got {shm}")
            if runs_driver:
                results = volumes.get(mounts.get(RESULTS_MOUNT, ""), {})
                claim = results.get("persistentVolumeClaim", {}).get("claimName")
                if claim is None:
                    problems.append(f"{where}: runs the driver but mounts no PVC at {RESULTS_MOUNT}")
                elif claim_names and claim not in claim_names:
                    problems.append(f"{where}: claims PVC {claim!r}, not among {sorted(claim_names)}")
    return problems


def cluster_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The RayClusterSpec of a RayJob or RayCluster (None for other kinds)."""
    if obj["kind"] == "RayJob":
        return obj["spec"]["rayClusterSpec"]
    return obj["spec"] if obj["kind"] == "RayCluster" else None


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def check_ray_auth(objects: list[dict[str, Any]]) -> list[str]:
    """Every Ray cluster runs with token authentication: ``authOptions.mode: token`` (KubeRay makes and
    hands out the token), or, without authOptions, RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret
    in every container of its pods and its submitter. No container anywhere turns it off."""
    problems = []
    for obj in objects:
        name = object_name(obj)
        spec = cluster_spec(obj)
        by_operator = spec is not None and "authOptions" in spec
        if by_operator and spec["authOptions"].get("mode") != "token":
            problems.append(f"{name}: authOptions {spec['authOptions']}, expected mode: token")
        for role, template, _, _ in pod_templates(obj):
            for container in containers(template):
                env = _env(container)
                mode = env.get("RAY_AUTH_MODE", {}).get("value")
                if mode is not None and mode != "token":
                    problems.append(f"{name} {role} container {container['name']}: RAY_AUTH_MODE={mode}")
                if spec is None or by_operator:
                    continue
                token = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
                if mode != "token" or not token.get("name") or token.get("key") != "auth_token":
                    problems.append(f"{name} {role} container {container['name']}: no authOptions, so it needs "
                                    "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret's auth_token")
    return problems


def _writable(template: dict[str, Any], container: dict[str, Any], path: str) -> bool:
    volumes = {volume["name"]: volume for volume in template["spec"].get("volumes", [])}
    mounted = {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}
    mount = mounted.get(path)
    return mount is not None and not mount.get("readOnly", False) and "emptyDir" in volumes.get(mount["name"], {})


def check_pod_hardening(objects: list[dict[str, Any]]) -> list[str]:
    """No service-account token; every container non-escalating, all capabilities dropped, on a read-only
    root file system with writable emptyDirs at /tmp and the image user's HOME, plus Ray's session dir in
    pods that run Ray (all but the RayJob's submitter)."""
    home = dockerfile_facts()["home"]
    problems = []
    for obj in objects:
        for role, template, _, _ in pod_templates(obj):
            where = f"{object_name(obj)} {role}"
            if template["spec"].get("automountServiceAccountToken") is not False:
                problems.append(f"{where}: automountServiceAccountToken must be false")
            writable = ["/tmp", home] + ([RAY_SESSION_DIR] if role != "submitter" else [])
            for container in containers(template):
                security = container.get("securityContext", {})
                if security.get("readOnlyRootFilesystem") is not True:
                    problems.append(f"{where} container {container['name']}: readOnlyRootFilesystem must be true")
                if security.get("allowPrivilegeEscalation") is not False:
                    problems.append(f"{where} container {container['name']}: allowPrivilegeEscalation must be false")
                if "ALL" not in security.get("capabilities", {}).get("drop", []):
                    problems.append(f"{where} container {container['name']}: capabilities must drop ALL")
                for path in writable:
                    if not _writable(template, container, path):
                        problems.append(f"{where} container {container['name']}: needs a writable emptyDir at {path}")
    return problems


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector}: only matchLabels is checked here"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def check_network_policies(objects: list[dict[str, Any]]) -> list[str]:
    """Each workload's pods (its submitter aside) are selected by an Ingress NetworkPolicy that carries the
    workload's component label; every policy admits only pods of this namespace (its own pods on any
    port, any other pod on the GCS / job API / client ports) and the KubeRay operator on the job API."""
    policies = [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    problems = []
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        for role, template, _, _ in pod_templates(obj):
            if role == "submitter":
                continue
            labels = template.get("metadata", {}).get("labels", {})
            guards = [policy for policy in policies if "Ingress" in policy["spec"].get("policyTypes", [])
                      and _selects(policy["spec"]["podSelector"], labels)
                      and policy["metadata"].get("labels", {}).get(COMPONENT_LABEL) == component]
            if not guards:
                problems.append(f"{object_name(obj)} {role}: no Ingress NetworkPolicy with component {component} "
                                f"selects its pods (labels {labels})")
    for policy in policies:
        name, own = object_name(policy), policy["spec"]["podSelector"]
        if not own.get("matchLabels"):
            problems.append(f"{name}: selects every pod of the namespace; select the workload's pods")
        for index, rule in enumerate(policy["spec"].get("ingress", [])):
            ports = {port.get("port") for port in rule.get("ports", [])}
            where = f"{name} ingress[{index}]"
            if not rule.get("from"):
                problems.append(f"{where}: admits every source")
            for peer in rule.get("from", []):
                if "ipBlock" in peer:
                    problems.append(f"{where}: ipBlock {peer['ipBlock']} admits addresses outside the namespace")
                elif "namespaceSelector" in peer:
                    if peer.get("podSelector", {}).get("matchLabels") != OPERATOR_POD_LABELS or not ports or \
                            not ports <= OPERATOR_PORTS:
                        problems.append(f"{where}: other namespaces may only reach the KubeRay operator's ports "
                                        f"{sorted(OPERATOR_PORTS)} from pods labelled {OPERATOR_POD_LABELS}")
                elif peer.get("podSelector") != own and (not ports or not ports <= RAY_CLIENT_PORTS):
                    problems.append(f"{where}: pods other than the workload's own may reach only "
                                    f"{sorted(RAY_CLIENT_PORTS)}, got ports {sorted(ports) or 'all'}")
    return problems


_QUANTITY_FACTORS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                     "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}


def quantity_bytes(quantity: Any) -> int:
    """Bytes of a Kubernetes quantity (``32Gi``, ``17179869184``); ValueError for anything else."""
    match = re.fullmatch(r"(\d+)([kMGTPE]i?|)", str(quantity))
    if match is None or match.group(2) not in _QUANTITY_FACTORS:
        raise ValueError(f"quantity={quantity!r}: expected digits and a binary or decimal suffix")
    return int(match.group(1)) * _QUANTITY_FACTORS[match.group(2)]


def check_multinode_workers(objects: list[dict[str, Any]], nodes: int) -> list[str]:
    """Every Ray workload runs ``nodes`` GPU worker pods, one per node: replicas = min = max = nodes; each
    pod with its node's 8 GPUs and the RDMA devices (request = limit), a required anti-affinity on the
    host name and a preferred affinity on a topology label (both selecting the workers' own labels),
    IPC_LOCK as the only added capability, /dev/shm in memory holding Ray's object store plus
    SHM_HEADROOM_PER_GPU per GPU, and the multi-node environment (MULTINODE_ENV)."""
    problems = []
    clusters = [obj for obj in objects if cluster_spec(obj) is not None]
    if not clusters:
        problems.append("no RayJob or RayCluster to run across nodes")
    for obj in clusters:
        name = object_name(obj)
        groups = cluster_spec(obj).get("workerGroupSpecs", [])
        if len(groups) != 1:
            problems.append(f"{name}: expected one GPU worker group, found {len(groups)}")
            continue
        (group,) = groups
        where = f"{name} worker group {group.get('groupName')}"
        counts = {key: group.get(key) for key in ("replicas", "minReplicas", "maxReplicas")}
        if any(count != nodes for count in counts.values()):
            problems.append(f"{where}: {counts}, expected {nodes} each (one pod per node, no autoscaling)")
        if group.get("numOfHosts", 1) != 1:
            problems.append(f"{where}: numOfHosts {group['numOfHosts']}, expected 1")
        template = group["template"]
        labels = template.get("metadata", {}).get("labels", {})
        pod = template["spec"]
        if gpus_of_pod(template) != GPUS_PER_NODE:
            problems.append(f"{where}: {gpus_of_pod(template)} GPUs per pod, expected the node's {GPUS_PER_NODE}")

        def own(selector: dict[str, Any]) -> bool:
            return bool(selector.get("matchLabels")) and _selects(selector, labels)

        affinity = pod.get("affinity", {})
        apart = affinity.get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
        if not any(term.get("topologyKey") == HOSTNAME_KEY and own(term.get("labelSelector", {})) for term in apart):
            problems.append(f"{where}: needs a required podAntiAffinity on {HOSTNAME_KEY} selecting its own pods "
                            "(one GPU worker per node)")
        together = affinity.get("podAffinity", {})
        if together.get("requiredDuringSchedulingIgnoredDuringExecution"):
            problems.append(f"{where}: a required podAffinity leaves the run pending when one topology domain lacks "
                            f"{nodes} free nodes; make it preferred")
        if not any(term.get("podAffinityTerm", {}).get("topologyKey") not in (None, HOSTNAME_KEY)
                   and own(term.get("podAffinityTerm", {}).get("labelSelector", {}))
                   for term in together.get("preferredDuringSchedulingIgnoredDuringExecution", [])):
            problems.append(f"{where}: needs a preferred podAffinity on a topology label (not the host name) "
                            "selecting its own pods")
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        store = quantity_bytes(group.get("rayStartParams", {}).get("object-store-memory", "0"))
        needed = store + GPUS_PER_NODE * SHM_HEADROOM_PER_GPU
        for container in pod["containers"]:
            at = f"{where} container {container['name']}"
            resources = container.get("resources", {})
            requested = resources.get("requests", {}).get(RDMA_RESOURCE)
            limited = resources.get("limits", {}).get(RDMA_RESOURCE)
            if limited is None or int(limited) < 1 or requested != limited:
                problems.append(f"{at}: {RDMA_RESOURCE} request {requested} / limit {limited}, expected equal and >= 1")
            capabilities = container.get("securityContext", {}).get("capabilities", {})
            if capabilities.get("add") != ["IPC_LOCK"]:
                problems.append(f"{at}: capabilities.add {capabilities.get('add')}, expected exactly ['IPC_LOCK']")
            env = {item["name"]: item.get("value") for item in container.get("env", [])}
            for variable, value in MULTINODE_ENV.items():
                if env.get(variable) != value:
                    problems.append(f"{at}: {variable} is {env.get(variable)!r}, expected {value!r}")
            for variable in MULTINODE_ENV_SET:
                if not env.get(variable):
                    problems.append(f"{at}: {variable} must name the HCAs to use")
            mounts = {mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts", [])}
            shm = volumes.get(mounts.get("/dev/shm", ""), {}).get("emptyDir", {})
            size = quantity_bytes(shm["sizeLimit"]) if "sizeLimit" in shm else 0
            if shm.get("medium") != "Memory" or size < needed:
                problems.append(f"{at}: /dev/shm {shm or 'missing'}, expected a Memory emptyDir of at least "
                                f"{needed >> 30} GiB (the object store's {store >> 30} GiB plus "
                                f"{SHM_HEADROOM_PER_GPU >> 30} GiB per GPU)")
    return problems


def check_multinode_network(objects: list[dict[str, Any]]) -> list[str]:
    """Every Ray workload's GPU workers admit the workload's other pods (its head and the workers on the
    other nodes) on every port: Ray's workers, the NVSHMEM unique-id bootstrap and NCCL / gloo listen on
    ephemeral ports. (check_network_policies keeps every rule inside the namespace.)"""
    policies = [obj for obj in objects if obj["kind"] == "NetworkPolicy"
                and "Ingress" in obj["spec"].get("policyTypes", [])]
    problems = []
    for obj in objects:
        if cluster_spec(obj) is None:
            continue
        head = cluster_spec(obj)["headGroupSpec"]["template"].get("metadata", {}).get("labels", {})
        for group in cluster_spec(obj).get("workerGroupSpecs", []):
            labels = group["template"].get("metadata", {}).get("labels", {})
            guards = [policy for policy in policies if _selects(policy["spec"]["podSelector"], labels)]
            if not any("ports" not in rule and any(
                    "podSelector" in peer and "namespaceSelector" not in peer
                    and _selects(peer["podSelector"], labels) and _selects(peer["podSelector"], head)
                    for peer in rule.get("from", []))
                    for policy in guards for rule in policy["spec"].get("ingress", [])):
                problems.append(f"{object_name(obj)} worker group {group['groupName']}: no NetworkPolicy admits its "
                                "head and the workers on the other nodes on every port (ephemeral ports of Ray's "
                                "workers, the NVSHMEM bootstrap, NCCL and gloo)")
    return problems


def check_dockerfile_rdma(text: str) -> list[str]:
    """The image installs the RDMA user space that NVSHMEM's and NCCL's InfiniBand transports load."""
    installs = " ".join(re.findall(r"apt-get install[^&\n]*", re.sub(r"\\\n", " ", text)))
    return [f"Dockerfile: no apt-get install of {package} (RDMA user space for the multi-node transports)"
            for package in RDMA_PACKAGES if not re.search(rf"(?<![\w.-]){re.escape(package)}(?![\w.-])", installs)]


# --------------------------------------------------------------------------------------------------
# Tests: parsing


def all_yaml_files() -> list[Path]:
    return sorted(K8S_DIR.rglob("*.yaml"))


def test_k8s_tree_has_the_expected_pieces():
    kinds = sorted(obj["kind"] for path in base_manifest_files() for obj in load_yaml_documents(path))
    assert kinds == ["Job", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "RayCluster",
                     "RayJob"], kinds
    assert [path.name for path in overlay_dirs()] == ["h200x4", "h200x8", "h200x8-2nodes"]
    assert [path.name for path in multinode_overlay_dirs()] == ["h200x8-2nodes"]
    assert sorted(path.parent.name for path in COMPONENTS_DIR.glob("*/kustomization.yaml")) == [
        "multinode", "token-secret"]


@pytest.mark.parametrize("path", all_yaml_files(), ids=lambda path: str(path.relative_to(K8S_DIR)))
def test_every_manifest_parses(path: Path):
    documents = load_yaml_documents(path)
    assert documents, f"{path} holds no YAML document"
    for document in documents:
        assert isinstance(document, dict) and document.get("apiVersion") and document.get("kind"), (
            f"{path}: every document needs apiVersion and kind, got {document!r:.200}"
        )


def test_every_base_file_is_a_kustomize_resource():
    """A manifest left out of kustomization.yaml would be validated here but never deployed."""
    kustomization = load_yaml_documents(BASE_DIR / "kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == sorted(path.name for path in base_manifest_files())


# --------------------------------------------------------------------------------------------------
# Tests: schema validation


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_kinds_validate_strictly(manifest_set, version: str):
    set_id, objects = manifest_set
    core = [obj for obj in objects if obj["kind"] not in CRD_FILES]
    jobs = {"Job"} if "job" in workloads_of(set_directory(set_id)) else set()
    assert {obj["kind"] for obj in core} == {"PersistentVolumeClaim", "NetworkPolicy"} | jobs, set_id
    for obj in core:
        validate_core(obj, version)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kuberay_pod_templates_and_metadata_validate_strictly(manifest_set, version: str):
    _, objects = manifest_set
    custom = [obj for obj in objects if obj["kind"] in CRD_FILES]
    assert sorted(obj["kind"] for obj in custom) == ["RayCluster", "RayJob"]
    for obj in custom:
        validate_core(as_object_meta_carrier(obj["metadata"]), version)
        for role, template, _, _ in pod_templates(obj):
            validate_core(as_pod_template(f"{obj['metadata']['name']}-{role.replace(' ', '-')}", template), version)


def test_kuberay_kinds_validate_against_crd_schemas(manifest_set, crd_validators):
    _, objects = manifest_set
    problems = [
        problem
        for obj in objects
        if obj["kind"] in CRD_FILES
        for problem in validate_custom_resource(obj, crd_validators)
    ]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------------
# Tests: cross-checks


def test_gpu_requests_match_config_world_size(manifest_set):
    _, objects = manifest_set
    problems = check_gpus_match_config(objects)
    assert not problems, "\n".join(problems)


def test_one_image_tag_everywhere(manifest_set):
    _, objects = manifest_set
    problems = check_images(objects, dockerfile_facts()["version"])
    assert not problems, "\n".join(problems)


def test_overlays_pin_the_dockerfile_image_version():
    version = dockerfile_facts()["version"]
    for directory in overlay_dirs():
        images = load_yaml_documents(directory / "kustomization.yaml")[0].get("images", [])
        assert [(image["name"], image.get("newTag")) for image in images] == [(IMAGE_NAME, version)], (
            f"{directory}: images {images}, expected {IMAGE_NAME} with newTag {version}"
        )


def test_project_version_matches_image_version():
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        pytest.fail("pyproject.toml is missing")
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    if "version" not in project:
        pytest.skip("pyproject.toml declares a dynamic version; the image label is the only version")
    assert project["version"] == dockerfile_facts()["version"]


def test_overlay_image_tag_reaches_every_container(tmp_path: Path):
    """kustomize's image transformer must rewrite images inside the KubeRay CRs too, not only the Job."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(BASE_DIR, probe)],
                "images": [{"name": IMAGE_NAME, "newTag": "probe-tag"}],
            }
        )
    )
    result = kustomize_build(probe)
    assert result.returncode == 0, result.stderr
    objects = [obj for obj in yaml.safe_load_all(result.stdout) if obj]
    assert check_images(objects, "probe-tag") == []
    assert sum(len(containers(t)) for obj in objects for _, t, _, _ in pod_templates(obj)) >= 6


def test_pods_match_the_image(manifest_set):
    _, objects = manifest_set
    problems = check_pods_match_image(objects)
    assert not problems, "\n".join(problems)


def test_gpu_pods_have_shm_multicast_off_and_results(manifest_set):
    _, objects = manifest_set
    problems = check_gpu_pods(objects)
    assert not problems, "\n".join(problems)


def test_ray_token_authentication_is_on(manifest_set):
    _, objects = manifest_set
    problems = check_ray_auth(objects)
    assert not problems, "\n".join(problems)
    assert all(cluster_spec(obj)["authOptions"] == {"mode": "token"} for obj in objects if cluster_spec(obj))


def test_pods_are_hardened(manifest_set):
    _, objects = manifest_set
    problems = check_pod_hardening(objects)
    assert not problems, "\n".join(problems)


def test_network_policies_admit_the_namespace_only(manifest_set):
    _, objects = manifest_set
    problems = check_network_policies(objects)
    assert not problems, "\n".join(problems)


def render_with_token_secret(tmp_path: Path) -> list[dict[str, Any]]:
    """The base with k8s/components/token-secret (for KubeRay < 1.5.1), as an overlay would add it."""
    overlay = tmp_path / "legacy-operator"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(BASE_DIR, overlay)],
        "components": [os.path.relpath(TOKEN_SECRET_COMPONENT, overlay)],
    }))
    result = kustomize_build(overlay)
    assert result.returncode == 0, result.stderr
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def test_token_secret_component_for_older_operators(tmp_path: Path, crd_validators):
    """Without authOptions every Ray container and the submitter read the token from the Secret; the
    result still validates and passes every other check."""
    objects = render_with_token_secret(tmp_path)
    for obj in objects:
        if cluster_spec(obj) is not None:
            assert "authOptions" not in cluster_spec(obj), object_name(obj)
    problems = (check_ray_auth(objects) + check_pod_hardening(objects) + check_network_policies(objects)
                + check_gpus_match_config(objects) + check_gpu_pods(objects) + check_pods_match_image(objects)
                + [problem for obj in objects if obj["kind"] in CRD_FILES
                   for problem in validate_custom_resource(obj, crd_validators)])
    assert not problems, "\n".join(problems)
    for obj in objects:
        if obj["kind"] in CRD_FILES:
            for _, template, _, _ in pod_templates(obj):
                validate_core(as_pod_template(obj["metadata"]["name"], template), KUBERNETES_VERSIONS[0])
    submitter = next(obj for obj in objects if obj["kind"] == "RayJob")["spec"]["submitterPodTemplate"]
    assert _env(submitter["spec"]["containers"][0])["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "flashdmoe-ray-token", "key": "auth_token"}


def test_component_selector_picks_one_workload(manifest_set):
    """docs/deploy.md applies `-l 'app.kubernetes.io/component in (results,<workload>)'`."""
    set_id, objects = manifest_set
    components = {}
    for obj in objects:
        component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        assert component, f"{object_name(obj)} has no {COMPONENT_LABEL} label"
        components.setdefault(component, []).append(obj["kind"])
    expected = {
        "results": ["PersistentVolumeClaim"],
        "rayjob": ["NetworkPolicy", "RayJob"],
        "raycluster": ["NetworkPolicy", "RayCluster"],
        "job": ["Job", "NetworkPolicy"],
    }
    workloads = workloads_of(set_directory(set_id))
    assert {component: sorted(kinds) for component, kinds in components.items()} == {
        component: kinds for component, kinds in expected.items() if component in workloads | {"results"}}


def test_dockerfile_contract():
    facts = dockerfile_facts()
    text = DOCKERFILE.read_text()
    assert check_dockerfile_rdma(text) == []
    for variable, value in MULTICAST_OFF_ENV.items():
        assert re.search(rf"\b{variable}={value}\b", facts["env"]), f"Dockerfile ENV lacks {variable}={value}"
    assert re.search(r"\bFLASHDMOE_CUDA_ARCH=sm_90a\b", facts["env"])
    assert int(facts["user"]) != 0
    assert re.search(r'^ENTRYPOINT \["flashdmoe"\]\s*$', text, flags=re.MULTILINE)
    assert re.search(r'^CMD \["info"\]\s*$', text, flags=re.MULTILINE)
    (base_image,) = re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
    assert re.fullmatch(r"nvcr\.io/nvidia/cuda:13\.0\.\d+-[a-z-]*devel-ubuntu\d+\.\d+", base_image), base_image
    assert re.search(r"^RUN .*\bflashdmoe build\b", re.sub(r"\\\n", " ", text), flags=re.MULTILINE)
    # the NVSHMEM build too, which a team across nodes runs
    assert re.search(r"^RUN .*\bflashdmoe build --nvshmem\b", re.sub(r"\\\n", " ", text), flags=re.MULTILINE)


# --------------------------------------------------------------------------------------------------
# Tests: N nodes x 8 GPUs (k8s/components/multinode)


@pytest.mark.parametrize("directory", multinode_overlay_dirs(), ids=lambda path: path.name)
def test_multinode_overlay_runs_its_settings(directory: Path):
    """The settings' node count reaches every worker group, and the settings' config (world_size 8 x nodes)
    is what the RayJob runs and both workloads are annotated with."""
    settings = multinode_settings(directory)
    nodes = int(settings["nodes"])
    assert nodes >= 2, f"{directory}: a multi-node overlay with nodes={nodes}"
    assert read_world_size(settings["config"]) == GPUS_PER_NODE * nodes, settings
    objects = rendered(directory)
    for obj in objects:
        if cluster_spec(obj) is not None:
            assert obj["metadata"]["annotations"][CONFIG_ANNOTATION] == settings["config"], object_name(obj)
            assert [group["replicas"] for group in cluster_spec(obj)["workerGroupSpecs"]] == [nodes]
    ray_job = next(obj for obj in objects if obj["kind"] == "RayJob")
    assert command_config(ray_job)[0] == settings["config"]
    assert check_gpus_match_config(objects) == []


@pytest.mark.parametrize("directory", multinode_overlay_dirs(), ids=lambda path: path.name)
def test_multinode_workers_one_per_node_with_gpus_rdma_shm_and_environment(directory: Path):
    nodes = int(multinode_settings(directory)["nodes"])
    problems = check_multinode_workers(rendered(directory), nodes)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("directory", multinode_overlay_dirs(), ids=lambda path: path.name)
def test_multinode_network_policies_admit_the_workers_to_each_other(directory: Path):
    objects = rendered(directory)
    problems = check_multinode_network(objects) + check_network_policies(objects)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("directory", multinode_overlay_dirs(), ids=lambda path: path.name)
def test_multinode_worker_pods_are_identical_across_workloads(directory: Path):
    """The RayCluster's GPU workers get the RayJob's pod spec (a replacement in the component)."""
    objects = {obj["kind"]: obj for obj in rendered(directory)}
    job_group = cluster_spec(objects["RayJob"])["workerGroupSpecs"][0]
    cluster_group = cluster_spec(objects["RayCluster"])["workerGroupSpecs"][0]
    assert job_group["template"]["spec"] == cluster_group["template"]["spec"]
    assert job_group["rayStartParams"] == cluster_group["rayStartParams"]


def render_multinode(tmp_path: Path, nodes: str, config: str) -> subprocess.CompletedProcess[str]:
    """The base with the multinode component and the given settings, as a new overlay would have them."""
    overlay = tmp_path / f"nodes-{nodes}"
    overlay.mkdir()
    (overlay / "run.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": MULTINODE_SETTINGS, "annotations": {"config.kubernetes.io/local-config": "true"}},
        "data": {"nodes": nodes, "config": config},
    }))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(BASE_DIR, overlay), "run.yaml"],
        "components": [os.path.relpath(MULTINODE_COMPONENT, overlay)],
    }))
    return kustomize_build(overlay)


def test_multinode_node_count_is_set_in_one_place(tmp_path: Path, crd_validators):
    """Changing the settings' nodes alone changes every worker group; the GPU cross-check then asks for a
    config of the new size, so the node count and the config cannot silently disagree."""
    result = render_multinode(tmp_path, "3", "configs/h200x8-2nodes.yaml")
    assert result.returncode == 0, result.stderr
    objects = [obj for obj in yaml.safe_load_all(result.stdout) if obj]
    assert "ConfigMap" not in {obj["kind"] for obj in objects}, "the local-config settings must not be emitted"
    problems = (check_multinode_workers(objects, 3) + check_multinode_network(objects) + check_pod_hardening(objects)
                + check_gpu_pods(objects) + [problem for obj in objects if obj["kind"] in CRD_FILES
                                             for problem in validate_custom_resource(obj, crd_validators)])
    assert not problems, "\n".join(problems)
    assert sorted(check_gpus_match_config(objects)) == [
        f"{kind}: requests 24 GPUs but configs/h200x8-2nodes.yaml has world_size 16"
        for kind in ("RayCluster/flashdmoe-interactive", "RayJob/flashdmoe-run")]


# --------------------------------------------------------------------------------------------------
# Tests: tools


@pytest.mark.parametrize("directory", [BASE_DIR] + overlay_dirs(), ids=lambda path: path.name)
def test_kustomize_renders(directory: Path):
    result = kustomize_build(directory)
    assert result.returncode == 0, result.stderr
    # PVC + per workload its object and its NetworkPolicy
    assert len([obj for obj in yaml.safe_load_all(result.stdout) if obj]) == 1 + 2 * len(workloads_of(directory))


def test_hadolint_passes_on_the_dockerfile():
    result = subprocess.run(
        [require_tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


# --------------------------------------------------------------------------------------------------
# Negative tests: every validator rejects a bad input


def base_object(kind: str) -> dict[str, Any]:
    (obj,) = [obj for path in base_manifest_files() for obj in load_yaml_documents(path) if obj["kind"] == kind]
    return obj


def test_core_validation_rejects_unknown_field_and_wrong_type():
    job = base_object("Job")
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError, match="'gpus' was unexpected"):
        validate_core(job, KUBERNETES_VERSIONS[0])
    job = base_object("Job")
    job["spec"]["backoffLimit"] = "never"
    with pytest.raises(kubernetes_validate.ValidationError, match="'never' is not of type"):
        validate_core(job, KUBERNETES_VERSIONS[0])


def test_pod_template_validation_rejects_typo_in_kuberay_template():
    ray_job = base_object("RayJob")
    worker = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    worker["spec"]["containers"][0]["resource"] = worker["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError, match="'resource' was unexpected"):
        validate_core(as_pod_template("worker", worker), KUBERNETES_VERSIONS[0])


def test_metadata_validation_rejects_unknown_field():
    ray_cluster = base_object("RayCluster")
    ray_cluster["metadata"]["label"] = {"team": "moe"}
    with pytest.raises(kubernetes_validate.ValidationError, match="'label' was unexpected"):
        validate_core(as_object_meta_carrier(ray_cluster["metadata"]), KUBERNETES_VERSIONS[0])


def test_crd_validation_rejects_unknown_field_the_raw_schema_accepts(crd_validators, raw_crd_validators):
    ray_job = base_object("RayJob")
    ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}
    assert validate_custom_resource(ray_job, raw_crd_validators) == [], "the shipped schema already rejects it"
    problems = validate_custom_resource(ray_job, crd_validators)
    assert any("'rayStartParam' was unexpected" in problem for problem in problems), problems


def test_crd_validation_rejects_wrong_types(crd_validators):
    ray_job = base_object("RayJob")
    ray_job["spec"]["entrypoint"] = ["flashdmoe", "run"]
    problems = validate_custom_resource(ray_job, crd_validators)
    assert any(problem.startswith("RayJob/flashdmoe-run: spec.entrypoint:") for problem in problems), problems
    ray_cluster = base_object("RayCluster")
    # rayStartParams values are strings; an unquoted number is a classic mistake.
    ray_cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    problems = validate_custom_resource(ray_cluster, crd_validators)
    assert any("rayStartParams.num-cpus: 0 is not of type 'string'" in problem for problem in problems), problems


def test_forbid_unknown_fields_respects_preserve_unknown_fields():
    schema = {
        "type": "object",
        "properties": {
            "open": {"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True},
            "closed": {"type": "object", "properties": {"a": {}}},
            "mapping": {"type": "object", "additionalProperties": {"type": "object", "properties": {"a": {}}}},
            "listed": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
        },
    }
    validator = jsonschema.Draft7Validator(forbid_unknown_fields(schema))
    assert validator.is_valid({"open": {"b": 1}})
    assert not validator.is_valid({"closed": {"b": 1}})
    assert not validator.is_valid({"mapping": {"key": {"b": 1}}})
    assert validator.is_valid({"mapping": {"key": {"a": 1}}})
    assert not validator.is_valid({"listed": [{"b": 1}]})
    assert not validator.is_valid({"unknown": 1})
    assert "additionalProperties" not in schema, "the input schema must not be modified"


def test_gpu_cross_check_rejects_mismatch_and_missing_config():
    job = base_object("Job")
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU_RESOURCE] = 4
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"][GPU_RESOURCE] = 4
    assert any("requests 4 GPUs but configs/h200x8.yaml has world_size 8" in p for p in check_gpus_match_config([job]))

    ray_job = base_object("RayJob")
    ray_job["spec"]["entrypoint"] = "flashdmoe run --config configs/no-such-config.yaml --output /results"
    ray_job["metadata"]["annotations"][CONFIG_ANNOTATION] = "configs/no-such-config.yaml"
    problems = check_gpus_match_config([ray_job])
    assert problems == ["RayJob/flashdmoe-run: config configs/no-such-config.yaml does not exist in the repository"]

    ray_cluster = base_object("RayCluster")
    ray_cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU_RESOURCE] = 1
    problems = check_gpus_match_config([ray_cluster])
    assert any("Ray head must be CPU-only" in problem for problem in problems), problems


def test_image_and_pod_cross_checks_reject_drift():
    ray_cluster = base_object("RayCluster")
    worker = ray_cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    worker["containers"][0]["image"] = f"{IMAGE_NAME}:0.0.9"
    assert check_images([ray_cluster], dockerfile_facts()["version"]) == [
        f"RayCluster/flashdmoe-interactive worker group gpu container ray-worker: image "
        f"'{IMAGE_NAME}:0.0.9', expected {IMAGE_NAME}:{dockerfile_facts()['version']}"
    ]
    worker["containers"][0]["workingDir"] = "/"
    worker["securityContext"]["runAsUser"] = 0
    ray_cluster["spec"]["rayVersion"] = "2.9.0"
    problems = check_pods_match_image([ray_cluster])
    assert len(problems) == 3, problems

    job = base_object("Job")
    pod = job["spec"]["template"]["spec"]
    pod["containers"][0]["env"] = [e for e in pod["containers"][0]["env"] if e["name"] != "NCCL_NVLS_ENABLE"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
    problems = check_gpu_pods([job])
    assert any("NCCL_NVLS_ENABLE" in p for p in problems) and any("/dev/shm" in p for p in problems), problems


def policy(name: str) -> dict[str, Any]:
    (obj,) = [obj for obj in load_yaml_documents(BASE_DIR / "networkpolicy.yaml") if obj["metadata"]["name"] == name]
    return obj


def test_auth_check_rejects_auth_off():
    ray_job = base_object("RayJob")
    ray_job["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "disabled"
    assert check_ray_auth([ray_job]) == ["RayJob/flashdmoe-run: authOptions {'mode': 'disabled'}, expected mode: token"]
    ray_cluster = base_object("RayCluster")
    del ray_cluster["spec"]["authOptions"]
    problems = check_ray_auth([ray_cluster])
    assert len(problems) == 2 and all("needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in p for p in problems), problems
    job = base_object("Job")
    job["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "RAY_AUTH_MODE", "value": "disabled"})
    assert check_ray_auth([job]) == ["Job/flashdmoe-embedded pod container flashdmoe: RAY_AUTH_MODE=disabled"]


def test_crd_schema_rejects_an_unknown_auth_mode(crd_validators):
    ray_cluster = base_object("RayCluster")
    ray_cluster["spec"]["authOptions"]["mode"] = "tokens"
    problems = validate_custom_resource(ray_cluster, crd_validators)
    assert any(problem.startswith("RayCluster/flashdmoe-interactive: spec.authOptions.mode:") for problem in problems)


def test_hardening_check_rejects_each_gap():
    ray_job = base_object("RayJob")
    head = ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    head["automountServiceAccountToken"] = True
    head["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    head["containers"][0]["volumeMounts"] = [m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] != "/tmp"]
    submitter = ray_job["spec"]["submitterPodTemplate"]["spec"]
    submitter["containers"][0]["securityContext"]["capabilities"]["drop"] = []
    submitter["volumes"] = [{"name": v["name"], "persistentVolumeClaim": {"claimName": "x"}} for v in submitter["volumes"]]
    problems = check_pod_hardening([ray_job])
    expected = ["head: automountServiceAccountToken must be false", "ray-head: readOnlyRootFilesystem must be true",
                "ray-head: needs a writable emptyDir at /tmp", "ray-job-submitter: capabilities must drop ALL",
                "ray-job-submitter: needs a writable emptyDir at /tmp",
                f"ray-job-submitter: needs a writable emptyDir at {dockerfile_facts()['home']}"]
    assert len(problems) == len(expected) and all(any(e in p for p in problems) for e in expected), problems
    job = base_object("Job")
    pod = job["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMounts"] = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] != RAY_SESSION_DIR]
    assert check_pod_hardening([job]) == [f"Job/flashdmoe-embedded pod container flashdmoe: needs a writable emptyDir at "
                                          f"{RAY_SESSION_DIR}"]


def test_network_policy_check_rejects_open_doors():
    ray_job = base_object("RayJob")
    run = policy("flashdmoe-run")
    assert check_network_policies([ray_job, run]) == []
    assert any("no Ingress NetworkPolicy with component rayjob" in p for p in check_network_policies([ray_job]))
    mislabelled = copy.deepcopy(run)
    mislabelled["metadata"]["labels"][COMPONENT_LABEL] = "raycluster"
    assert any("no Ingress NetworkPolicy" in p for p in check_network_policies([ray_job, mislabelled]))

    leaky = copy.deepcopy(run)
    leaky["spec"]["ingress"].append({"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    leaky["spec"]["ingress"].append({"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 6379}]})
    leaky["spec"]["ingress"].append({"from": [{"podSelector": {}}]})
    leaky["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 8265}]})
    problems = check_network_policies([ray_job, leaky])
    expected = ["ingress[3]: ipBlock", "ingress[4]: other namespaces may only reach",
                "ingress[5]: pods other than the workload's own may reach only", "ingress[6]: admits every source"]
    assert len(problems) == 4 and all(any(e in p for p in problems) for e in expected), problems
    everyone = copy.deepcopy(policy("flashdmoe-embedded"))
    everyone["spec"]["podSelector"] = {}
    assert check_network_policies([everyone]) == ["NetworkPolicy/flashdmoe-embedded: selects every pod of the "
                                                  "namespace; select the workload's pods"]


def multinode_object(kind: str) -> dict[str, Any]:
    """The RayJob or RayCluster of the first multi-node overlay, as rendered (a fresh copy)."""
    return next(obj for obj in rendered(multinode_overlay_dirs()[0]) if obj["kind"] == kind)


def multinode_worker(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(worker group, pod spec, container) of a rendered multi-node RayJob / RayCluster."""
    group = cluster_spec(obj)["workerGroupSpecs"][0]
    return group, group["template"]["spec"], group["template"]["spec"]["containers"][0]


def test_multinode_check_rejects_wrong_counts_and_placement():
    nodes = int(multinode_settings(multinode_overlay_dirs()[0])["nodes"])
    ray_job = multinode_object("RayJob")
    assert check_multinode_workers([ray_job], nodes) == []
    group, pod, container = multinode_worker(ray_job)
    group["maxReplicas"] = nodes + 1
    container["resources"]["limits"][GPU_RESOURCE] = container["resources"]["requests"][GPU_RESOURCE] = 4
    pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] = \
        "topology.kubernetes.io/zone"
    pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] = [
        pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"].pop()["podAffinityTerm"]]
    problems = check_multinode_workers([ray_job], nodes)
    expected = [f"'maxReplicas': {nodes + 1}}}, expected {nodes} each", "4 GPUs per pod",
                f"required podAntiAffinity on {HOSTNAME_KEY}", "a required podAffinity leaves the run pending",
                "needs a preferred podAffinity on a topology label"]
    assert len(problems) == len(expected) and all(any(e in p for p in problems) for e in expected), problems

    ray_cluster = multinode_object("RayCluster")
    _, pod, _ = multinode_worker(ray_cluster)
    # Anti-affinity against some other pods does not keep this workload's workers apart.
    pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"] = {
        "matchLabels": {"app.kubernetes.io/component": "job"}}
    problems = check_multinode_workers([ray_cluster], nodes)
    assert len(problems) == 1 and "required podAntiAffinity" in problems[0], problems
    assert any("expected 1 each" in p for p in check_multinode_workers([multinode_object("RayJob")], 1))
    assert check_multinode_workers([], nodes) == ["no RayJob or RayCluster to run across nodes"]


def test_multinode_check_rejects_missing_rdma_extra_capabilities_and_small_shm():
    nodes = int(multinode_settings(multinode_overlay_dirs()[0])["nodes"])
    ray_job = multinode_object("RayJob")
    group, pod, container = multinode_worker(ray_job)
    del container["resources"]["limits"][RDMA_RESOURCE]
    container["securityContext"]["capabilities"]["add"] = ["IPC_LOCK", "SYS_ADMIN"]
    next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] = "16Gi"
    problems = check_multinode_workers([ray_job], nodes)
    expected = [f"{RDMA_RESOURCE} request 1 / limit None", "capabilities.add ['IPC_LOCK', 'SYS_ADMIN']",
                "/dev/shm {'medium': 'Memory', 'sizeLimit': '16Gi'}, expected a Memory emptyDir of at least 24 GiB"]
    assert len(problems) == len(expected) and all(any(e in p for p in problems) for e in expected), problems

    ray_job = multinode_object("RayJob")
    group, pod, container = multinode_worker(ray_job)
    del container["securityContext"]["capabilities"]["add"]
    container["resources"]["requests"][RDMA_RESOURCE] = 2
    # A larger object store must take the /dev/shm volume with it.
    group["rayStartParams"]["object-store-memory"] = str(30 << 30)
    next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["medium"] = ""
    problems = check_multinode_workers([ray_job], nodes)
    expected = [f"{RDMA_RESOURCE} request 2 / limit 1", "capabilities.add None",
                "expected a Memory emptyDir of at least 38 GiB (the object store's 30 GiB"]
    assert len(problems) == len(expected) and all(any(e in p for p in problems) for e in expected), problems


def test_multinode_check_rejects_single_node_or_multicast_environment():
    nodes = int(multinode_settings(multinode_overlay_dirs()[0])["nodes"])
    ray_cluster = multinode_object("RayCluster")
    _, _, container = multinode_worker(ray_cluster)
    # The base's single-node environment: loopback sockets, no network transport.
    container["env"] = copy.deepcopy(base_object("RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
                                     ["containers"][0]["env"])
    problems = check_multinode_workers([ray_cluster], nodes)
    expected = ["FLASHDMOE_KERNEL_BUILD is None, expected 'nvshmem'",
                "NVSHMEM_REMOTE_TRANSPORT is 'none', expected 'ibrc'", "NVSHMEM_IB_ENABLE_IBGDA is None",
                "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME is 'lo', expected 'eth0'", "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY is None",
                "NCCL_SOCKET_IFNAME is 'lo'", "NCCL_IB_DISABLE is '1', expected '0'", "GLOO_SOCKET_IFNAME is 'lo'",
                "NCCL_IB_HCA must name the HCAs"]
    assert len(problems) == len(expected) and all(any(e in p for p in problems) for e in expected), problems

    ray_job = multinode_object("RayJob")
    _, _, container = multinode_worker(ray_job)
    env = {item["name"]: item for item in container["env"]}
    env["NVSHMEM_DISABLE_NVLS"]["value"] = "0"
    env["NCCL_IB_HCA"]["value"] = ""
    container["env"] = [item for item in container["env"] if item["name"] != "TORCH_SYMM_MEM_DISABLE_MULTICAST"]
    problems = check_multinode_workers([ray_job], nodes)
    expected = ["NVSHMEM_DISABLE_NVLS is '0', expected '1'", "TORCH_SYMM_MEM_DISABLE_MULTICAST is None",
                "NCCL_IB_HCA must name the HCAs"]
    assert len(problems) == len(expected) and all(any(e in p for p in problems) for e in expected), problems


def test_multinode_network_check_rejects_port_limited_or_missing_peer_rule():
    objects = rendered(multinode_overlay_dirs()[0])
    assert check_multinode_network(objects) == []
    run = next(obj for obj in objects if obj["metadata"]["name"] == "flashdmoe-run")
    # The rule between the workload's own pods limited to Ray's client ports: the bootstrap is cut off.
    run["spec"]["ingress"][0]["ports"] = [{"protocol": "TCP", "port": 6379}]
    assert check_multinode_network(objects) == [
        "RayJob/flashdmoe-run worker group gpu: no NetworkPolicy admits its head and the workers on the other nodes "
        "on every port (ephemeral ports of Ray's workers, the NVSHMEM bootstrap, NCCL and gloo)"]
    interactive = next(obj for obj in objects if obj["metadata"]["name"] == "flashdmoe-interactive")
    # Workers admitting only each other: the head (the driver) cannot reach them.
    interactive["spec"]["ingress"][0]["from"] = [{"podSelector": {"matchLabels": {"flashdmoe.io/role": "gpu-worker"}}}]
    problems = check_multinode_network(objects)
    assert len(problems) == 2 and "RayCluster/flashdmoe-interactive worker group gpu" in problems[0], problems


def test_multinode_settings_must_be_a_local_config(tmp_path: Path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": MULTINODE_SETTINGS},
        "data": {"nodes": "2", "config": "configs/h200x8-2nodes.yaml"}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["run.yaml"]}))
    with pytest.raises(AssertionError, match="must be local-config"):
        multinode_settings(tmp_path)


def test_multinode_component_rejects_a_base_it_does_not_fit(tmp_path: Path):
    """The component's index-based patches test what they address: a reordered base fails the build."""
    base = tmp_path / "base"
    shutil.copytree(BASE_DIR, base)
    ray_job = base / "rayjob.yaml"
    ray_job.write_text(ray_job.read_text().replace("            volumes:\n              - name: dshm",
                                                   "            volumes:\n              - name: shm", 1))
    component = tmp_path / "components" / "multinode"
    shutil.copytree(MULTINODE_COMPONENT, component)
    overlay = tmp_path / "overlays" / "nodes"
    overlay.mkdir(parents=True)
    shutil.copy(multinode_overlay_dirs()[0] / "run.yaml", overlay / "run.yaml")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["../../base", "run.yaml"], "components": ["../../components/multinode"]}))
    result = kustomize_build(overlay)
    assert result.returncode != 0 and "volumes/0/name" in result.stderr, result.stderr


def test_quantity_bytes():
    assert quantity_bytes("32Gi") == 32 << 30 and quantity_bytes("17179869184") == 16 << 30
    assert quantity_bytes("2G") == 2 * 10**9 and quantity_bytes(512) == 512
    for bad in ("32GB", "1.5Gi", "ki", "-1"):
        with pytest.raises(ValueError, match="quantity="):
            quantity_bytes(bad)


def test_dockerfile_rdma_check_rejects_an_image_without_verbs():
    text = DOCKERFILE.read_text()
    assert check_dockerfile_rdma(text) == []
    stripped = re.sub(r"^\s*(libibverbs1|ibverbs-providers) \\\n", "", text, flags=re.MULTILINE)
    assert check_dockerfile_rdma(stripped) == [
        f"Dockerfile: no apt-get install of {package} (RDMA user space for the multi-node transports)"
        for package in RDMA_PACKAGES]
    # Mentioned in a comment is not installed.
    assert len(check_dockerfile_rdma("# libibverbs1 ibverbs-providers\nRUN apt-get install -y wget\n")) == 2


def test_kustomize_build_fails_on_a_broken_overlay(tmp_path: Path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    result = kustomize_build(tmp_path)
    assert result.returncode != 0 and "missing.yaml" in result.stderr


def test_hadolint_rejects_a_bad_dockerfile(tmp_path: Path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run(
        [require_tool("hadolint"), "--failure-threshold", "info", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout


def test_crd_directory_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Missing CRDs fail loudly; only an explicit empty FLASHDMOE_CRD_DIR opts out."""
    monkeypatch.setenv(CRD_DIR_ENV, "")
    assert crd_directory() is None
    monkeypatch.setenv(CRD_DIR_ENV, str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="KubeRay CRDs not found"):
        crd_directory()
