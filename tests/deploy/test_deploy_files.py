"""deploy/: every YAML and JSON file parses; the Kubernetes objects load into the official client's
models with every field recognised; the S3 lifecycle rule and IAM policy are accepted by the S3 and
IAM APIs (moto server); the Dockerfiles copy files that exist and run the resuming entrypoint.

The IAM policy's *content* is checked against a real run in ``test_iam_policy.py``.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
JSON_FILES = sorted(DEPLOY.rglob("*.json"))
JOBS = sorted((DEPLOY / "kubernetes").glob("job-*.yaml"))
SERVICE_ACCOUNTS = sorted((DEPLOY / "kubernetes").glob("serviceaccount-*.yaml"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_recipes_are_all_there():
    names = {_rel(p) for p in YAML_FILES + JSON_FILES}
    assert names == {
        "deploy/docker-compose.yml",
        "deploy/iam/gcs-binding.json",
        "deploy/iam/gcs-role.yaml",
        "deploy/iam/s3-lifecycle.json",
        "deploy/iam/s3-policy.json",
        "deploy/kubernetes/job-eks.yaml",
        "deploy/kubernetes/job-gke.yaml",
        "deploy/kubernetes/job-static-credentials.yaml",
        "deploy/kubernetes/serviceaccount-eks.yaml",
        "deploy/kubernetes/serviceaccount-gke.yaml",
        "deploy/skypilot/train.yaml",
    }


@pytest.mark.parametrize("path", YAML_FILES, ids=_rel)
def test_yaml_parses_to_mappings(path):
    documents = list(yaml.safe_load_all(path.read_text()))
    assert documents and all(isinstance(doc, dict) and doc for doc in documents)


@pytest.mark.parametrize("path", JSON_FILES, ids=_rel)
def test_json_parses_to_an_object(path):
    document = json.loads(path.read_text())
    assert isinstance(document, dict) and document


class _Response:
    """What ``ApiClient.deserialize`` reads: a response with a JSON body in ``data``."""

    def __init__(self, document: dict) -> None:
        self.data = json.dumps(document)


def _load(path: Path, kind: str):
    document = yaml.safe_load(path.read_text())
    client = ApiClient()
    if "content_type" in inspect.signature(client.deserialize).parameters:  # newer clients take text
        model = client.deserialize(json.dumps(document), kind, "application/json")
    else:
        model = client.deserialize(_Response(document), kind)
    # The client drops keys it does not know: serialising back must give the document again, so a
    # misspelled or misplaced field fails here instead of being ignored by the cluster.
    assert client.sanitize_for_serialization(model) == document
    return model


@pytest.mark.parametrize("path", JOBS, ids=_rel)
def test_job_loads_into_v1job_and_survives_preemption(path):
    job = _load(path, "V1Job")
    assert (job.api_version, job.kind) == ("batch/v1", "Job")
    spec, pod = job.spec, job.spec.template.spec
    # The Job controller (not the kubelet on the dying node) makes the next pod, on another node.
    assert pod.restart_policy == "Never"
    assert 1 <= spec.backoff_limit <= 10
    (container,) = pod.containers
    assert container.name == "train"
    rules = spec.pod_failure_policy.rules
    ignore_disruption = [r for r in rules if r.action == "Ignore" and r.on_pod_conditions]
    assert [c.type for r in ignore_disruption for c in r.on_pod_conditions] == ["DisruptionTarget"]
    by_exit = {r.action: r.on_exit_codes for r in rules if r.on_exit_codes}
    assert by_exit["Ignore"].values == [143] and by_exit["Ignore"].container_name == "train"
    assert by_exit["FailJob"].values == [5, 6] and by_exit["FailJob"].operator == "In"
    # Nothing local carries state between starts: no volume, no mount.
    assert not pod.volumes and not container.volume_mounts
    env = {e.name: e.value for e in container.env}
    assert re.fullmatch(r"(s3|gs)://my-bucket/runs/run-1", env["OPD_STORE_URL"])
    assert int(env["OPD_UPDATES"]) > int(env["OPD_CHECKPOINT_EVERY"]) > 0
    assert container.command is None and container.args is None  # the image's resuming entrypoint


def test_eks_job_targets_spot_with_the_aws_notice():
    job = _load(DEPLOY / "kubernetes/job-eks.yaml", "V1Job")
    pod = job.spec.template.spec
    assert pod.node_selector == {"eks.amazonaws.com/capacityType": "SPOT"}
    assert {t.key for t in pod.tolerations} == {"eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type"}
    assert pod.termination_grace_period_seconds == 110  # AWS: 120 s notice
    assert pod.service_account_name == "opd-train"
    assert pod.containers[0].env_from is None  # credentials from IRSA, not a Secret


def test_gke_job_targets_spot_with_the_gce_notice():
    job = _load(DEPLOY / "kubernetes/job-gke.yaml", "V1Job")
    pod = job.spec.template.spec
    assert pod.node_selector["cloud.google.com/gke-spot"] == "true"
    assert [(t.key, t.value, t.effect) for t in pod.tolerations] == [("cloud.google.com/gke-spot", "true", "NoSchedule")]
    assert pod.termination_grace_period_seconds == 15  # GKE: 15 s of the 30 s notice for pods
    assert pod.service_account_name == "opd-train"


def test_static_credentials_job_reads_a_secret():
    job = _load(DEPLOY / "kubernetes/job-static-credentials.yaml", "V1Job")
    container = job.spec.template.spec.containers[0]
    assert [ref.secret_ref.name for ref in container.env_from] == ["opd-store-s3"]
    assert job.spec.template.spec.automount_service_account_token is False


@pytest.mark.parametrize("path", SERVICE_ACCOUNTS, ids=_rel)
def test_service_accounts_load(path):
    account = _load(path, "V1ServiceAccount")
    assert account.metadata.name == "opd-train"
    (key,) = account.metadata.annotations
    assert key in ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account")


def test_skypilot_job_uses_spot_and_resumes_through_the_entrypoint():
    task = yaml.safe_load((DEPLOY / "skypilot/train.yaml").read_text())
    assert task["resources"]["use_spot"] is True
    assert task["resources"]["job_recovery"]["max_restarts_on_errors"] >= 1
    assert task["envs"]["OPD_STORE_URL"].startswith(("s3://", "gs://"))
    assert "exec sh deploy/entrypoint.sh" in task["run"]
    assert '"torch==2.13.0"' in task["setup"] and '".[s3,gcs,job]"' in task["setup"]


def test_compose_runs_the_job_against_its_own_s3_server():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"s3", "create-bucket", "train"}
    assert services["s3"]["entrypoint"][:3] == ["python", "-m", "moto.server"]
    train = services["train"]
    assert "volumes" not in train
    env = train["environment"]
    assert env["OPD_S3_ENDPOINT_URL"] == "http://s3:5000"
    bucket = env["OPD_STORE_URL"].removeprefix("s3://").split("/")[0]
    assert f"Bucket='{bucket}'" in services["create-bucket"]["entrypoint"][-1]
    assert train["build"]["dockerfile"] == "deploy/Dockerfile" and train["build"]["context"] == ".."


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_installs_pinned_torch_and_runs_the_entrypoint(name):
    text = (DEPLOY / name).read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0].split()[0] == "FROM" and "python:3.11-slim" in lines[0]
    assert any('pip install "torch==2.13.0"' in line for line in lines)
    assert any('pip install ".[s3,gcs,job]"' in line for line in lines)
    assert lines[-1] == 'ENTRYPOINT ["tini", "--", "opd-entrypoint"]'
    for line in lines:
        if line.startswith("COPY "):
            *sources, _target = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), f"{name}: COPY source {source} is not in the build context"


def test_lifecycle_rule_is_accepted_by_s3(moto_s3):
    moto_s3.new_backend("my-bucket")
    client = moto_s3.boto3_client()
    rules = json.loads((DEPLOY / "iam/s3-lifecycle.json").read_text())
    client.put_bucket_lifecycle_configuration(Bucket="my-bucket", LifecycleConfiguration=rules)
    (rule,) = client.get_bucket_lifecycle_configuration(Bucket="my-bucket")["Rules"]
    assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    assert rule["Status"] == "Enabled" and rule["Filter"] == {"Prefix": "runs/"}


def test_s3_policy_is_a_valid_iam_policy_document(moto_s3):
    import boto3

    moto_s3.reset()
    iam = boto3.client("iam", endpoint_url=moto_s3.endpoint_url, aws_access_key_id="testing",
                       aws_secret_access_key="testing", region_name="us-east-1")
    document = (DEPLOY / "iam/s3-policy.json").read_text()
    created = iam.create_policy(PolicyName="opd-train-run-1", PolicyDocument=document)["Policy"]
    version = iam.get_policy_version(PolicyArn=created["Arn"], VersionId=created["DefaultVersionId"])
    stored = version["PolicyVersion"]["Document"]
    stored = json.loads(stored) if isinstance(stored, str) else stored
    assert stored == json.loads(document)
    with pytest.raises(iam.exceptions.MalformedPolicyDocumentException):
        iam.create_policy(PolicyName="broken", PolicyDocument=document.replace('"Effect": "Allow"', '"Effect": "Permit"', 1))


def test_gcs_role_and_binding_name_only_storage_permissions_for_the_run():
    role = yaml.safe_load((DEPLOY / "iam/gcs-role.yaml").read_text())
    assert sorted(role["includedPermissions"]) == [
        "storage.buckets.get",
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.list",
    ]
    (binding,) = json.loads((DEPLOY / "iam/gcs-binding.json").read_text())["bindings"]
    assert binding["role"].endswith("/roles/opdStoreRun")
    assert 'startsWith("projects/_/buckets/my-bucket/objects/runs/run-1/")' in binding["condition"]["expression"]


def test_a_misspelled_job_field_is_caught(tmp_path):
    text = (DEPLOY / "kubernetes/job-eks.yaml").read_text()
    broken = tmp_path / "job.yaml"
    broken.write_text(text.replace("terminationGracePeriodSeconds:", "terminationGracePeriodSecond:", 1))
    with pytest.raises(AssertionError):
        _load(broken, "V1Job")
