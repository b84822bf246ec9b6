"""examples/tfjob.yaml: every field real, every flag one digits.py accepts.

No Kubernetes cluster is needed. Each YAML document is loaded strictly into
the models of the Kubeflow training operator's SDK (``kubeflow-training``)
and of the Kubernetes Python client: a key the model does not have (a
misspelt field), a value of the wrong type or a missing required field fails,
naming its path. The client's own deserializer drops unknown keys silently,
which is why the walk is ours; the models still do the required-field
checks. Then the NetworkPolicy must admit exactly the job's own pods on the
task port, and every task's command must parse with examples/digits.py's own
argument parser.

Then the rehearsal (tools/tfjob): the manifest's pods run on emulated hosts
of this machine with the TF_CONFIG the training operator injects, and train
to the end.
"""

import copy
import datetime
import os
import pathlib
import re
import subprocess
import sys

import pytest

import support

_WHY = "tests/test_tfjob.py checks examples/tfjob.yaml against its models"
kubeflow_training = support.require("kubeflow.training", why=_WHY)
kubernetes = support.require("kubernetes", why=_WHY)
# PyYAML is a dependency of the kubernetes client.
yaml = support.require("yaml", why="tests/test_tfjob.py reads "
                       "examples/tfjob.yaml with it")

from examples import digits  # pylint: disable=g-import-not-at-top

# Version-independent (tests/conftest.py): the manifest's models, tools/tfjob
# and its emulated hosts import no TensorFlow, and the digits example its
# pods run reads TF_CONFIG itself (examples/_task.py) and is tested under
# every TensorFlow (test_examples): CI runs this file under its newest only.
pytestmark = pytest.mark.version_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "tfjob.yaml"
JOB_LABEL = "training.kubeflow.org/job-name"
_MODELS = {
    ("kubeflow.org/v1", "TFJob"): "KubeflowOrgV1TFJob",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
}
_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool,
               "object": object}


class ManifestError(ValueError):
  pass


def _model_class(name):
  for module in (kubeflow_training.models, kubernetes.client.models):
    if hasattr(module, name):
      return getattr(module, name)
  raise ManifestError("no model %s in kubeflow-training or kubernetes" % name)


def _strict(value, type_name, path):
  """``value`` as ``type_name`` (an openapi type string), checked strictly."""
  if value is None:
    return None
  match = re.fullmatch(r"list\[(.+)\]", type_name)
  if match:
    if not isinstance(value, list):
      raise ManifestError("%s: expected a list, got %r" % (path, value))
    return [_strict(v, match.group(1), "%s[%d]" % (path, i))
            for i, v in enumerate(value)]
  match = re.fullmatch(r"dict\(str, (.+)\)", type_name)
  if match:
    if not isinstance(value, dict):
      raise ManifestError("%s: expected a mapping, got %r" % (path, value))
    return {k: _strict(v, match.group(1), "%s.%s" % (path, k))
            for k, v in value.items()}
  if type_name in _PRIMITIVES:
    wanted = _PRIMITIVES[type_name]
    # YAML's true/false are ints to Python; the API does not take them so.
    if (not isinstance(value, wanted) or
        (isinstance(value, bool) and type_name in ("int", "float"))):
      raise ManifestError("%s: expected %s, got %r (%s)" % (
          path, type_name, value, type(value).__name__))
    return value
  if type_name == "datetime":
    if not isinstance(value, (str, datetime.datetime)):
      raise ManifestError("%s: expected a timestamp, got %r" % (path, value))
    return value
  cls = _model_class(type_name)
  if not isinstance(value, dict):
    raise ManifestError("%s: expected a %s mapping, got %r" % (
        path, type_name, value))
  by_key = {key: attr for attr, key in cls.attribute_map.items()}
  unknown = sorted(set(value) - set(by_key))
  if unknown:
    raise ManifestError("%s: %s has no field %s (its fields: %s)" % (
        path, type_name, ", ".join(map(repr, unknown)),
        ", ".join(sorted(by_key))))
  kwargs = {by_key[k]: _strict(v, cls.openapi_types[by_key[k]],
                               "%s.%s" % (path, k))
            for k, v in value.items()}
  try:
    return cls(**kwargs)
  except ValueError as e:  # The model's own check: a required field.
    raise ManifestError("%s: %s" % (path, e)) from None


def load(documents):
  """Every document as its model; raises ManifestError naming the path."""
  loaded = []
  for i, doc in enumerate(documents):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in _MODELS:
      raise ManifestError("document %d: unexpected apiVersion/kind %s, "
                          "expected one of %s" % (i, key, sorted(_MODELS)))
    loaded.append(_strict(doc, _MODELS[key], "document %d (%s)" % (
        i, key[1])))
  return loaded


def _documents():
  return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_every_document_loads_into_the_operator_and_kubernetes_models():
  job, policy = load(_documents())
  assert isinstance(job, kubeflow_training.KubeflowOrgV1TFJob)
  assert isinstance(policy, kubernetes.client.V1NetworkPolicy)
  specs = job.spec.tf_replica_specs
  assert sorted(specs) == ["Chief", "PS", "Worker"]
  for spec in specs.values():
    container = spec.template.spec.containers[0]
    assert container.name == "tensorflow"  # The operator looks for it.


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d[0]["spec"]["tfReplicaSpecs"]["PS"].update(replica=1),
     r"KubeflowOrgV1ReplicaSpec has no field 'replica'"),
    (lambda d: d[0]["spec"]["tfReplicaSpecs"]["Worker"].update(
        replicas="3"), r"Worker\.replicas: expected int, got '3'"),
    (lambda d: d[0]["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]
     .pop("containers"), r"Chief\.template\.spec: Invalid value for "
     r"`containers`, must not be `None`"),
    (lambda d: d[1]["spec"]["ingress"][0].update(form=[]),
     r"V1NetworkPolicyIngressRule has no field 'form'"),
], ids=["misspelt-field", "wrong-type", "missing-required", "policy-typo"])
def test_loader_rejects_what_kubernetes_would(mutate, message):
  documents = copy.deepcopy(_documents())
  mutate(documents)
  with pytest.raises(ManifestError, match=message):
    load(documents)


def test_network_policy_admits_only_the_jobs_pods_on_the_task_port():
  job, policy = load(_documents())
  name = job.metadata.name
  ports = {p.container_port for s in job.spec.tf_replica_specs.values()
           for c in s.template.spec.containers for p in c.ports}
  assert ports == {2222}
  spec = policy.spec
  assert spec.pod_selector.match_labels == {JOB_LABEL: name}
  assert spec.policy_types == ["Ingress"]
  assert len(spec.ingress) == 1
  rule = spec.ingress[0]
  assert [(p.protocol, p.port) for p in rule.ports] == [("TCP", 2222)]
  assert len(rule._from) == 1  # pylint: disable=protected-access
  peer = rule._from[0]  # pylint: disable=protected-access
  assert peer.pod_selector.match_labels == {JOB_LABEL: name}
  assert peer.namespace_selector is None and peer.ip_block is None


def test_every_task_command_parses_with_the_digits_parser():
  job, _ = load(_documents())
  for replica, spec in job.spec.tf_replica_specs.items():
    container = spec.template.spec.containers[0]
    assert container.command == ["python", "-m", "examples.digits"], replica
    try:
      args = digits._parse(container.args)  # pylint: disable=protected-access
    except SystemExit:
      pytest.fail("%s's args %r are not flags examples/digits.py accepts "
                  "(its parser's message is above)" % (replica, container.args))
    assert args.backups == 1, replica
  chief = job.spec.tf_replica_specs["Chief"].template.spec.containers[0]
  logdir = digits._parse(chief.args).logdir  # pylint: disable=protected-access
  assert any(logdir.startswith(m.mount_path) for m in chief.volume_mounts), (
      "the chief's --logdir %s is not on a mounted volume" % logdir)


#: The TF_CONFIG the Kubeflow training operator gives this manifest's worker
#: 1 in namespace "default", as its genTFConfigJSONStr writes it (Go's
#: json.Marshal: struct fields in order, map keys sorted, no spaces).
_OPERATORS_WORKER_1 = (
    '{"cluster":{"chief":["sync-replicas-digits-chief-0.default.svc:2222"],'
    '"ps":["sync-replicas-digits-ps-0.default.svc:2222"],"worker":['
    '"sync-replicas-digits-worker-0.default.svc:2222",'
    '"sync-replicas-digits-worker-1.default.svc:2222",'
    '"sync-replicas-digits-worker-2.default.svc:2222"]},'
    '"task":{"type":"worker","index":1},"environment":"cloud"}')


@pytest.mark.timeout(300)
@pytest.mark.skipif(not support.is_machine_root(), reason=(
    "emulated hosts need the machine's root here: /run/netns and /etc/hosts "
    "are mounted over in the rehearsal's own mount namespace"))
def test_the_manifests_pods_train_on_emulated_hosts_with_the_operators_tf_config(
    tmp_path):
  # Every pod on a host of its own, its service name resolving to it, the
  # manifest's command and args; only the steps cut from 2000 (about 80 s
  # here) to 300, and /logs mapped to tmp_path/logs.
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "tools" / "tfjob"), str(MANIFEST),
       "--link-rate", "1gbit", "--volumes", str(tmp_path),
       "--set=--steps=300", "--timeout", "240"], cwd=ROOT,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=280)
  finally:
    support.kill_group(proc)
  text = out.decode(errors="replace")
  assert proc.returncode == 0, text[-6000:]
  configs = dict(re.findall(r"\[launch\] (\w+-\d) \S+ at \S+: TF_CONFIG=(.*)\n",
                            text))
  assert sorted(configs) == ["chief-0", "ps-0", "worker-0", "worker-1",
                             "worker-2"], text[:3000]
  assert configs["worker-1"] == _OPERATORS_WORKER_1
  addresses = re.findall(r"\[launch\] \w+-\d \S+ at (\S+):", text)
  assert len(set(addresses)) == 5, addresses
  # The ps read its address from TF_CONFIG: the service's name.
  assert ("[ps0] ps0 serving at sync-replicas-digits-ps-0.default.svc:2222"
          in text), text[-4000:]
  for task in ("chief0", "worker0", "worker1", "worker2"):
    assert "[launch] %s exited 0\n" % task in text, text[-4000:]
  assert re.search(r"\[chief0\] final test accuracy 0\.9\d+ .* at step 300 ",
                   text), text[-4000:]
  assert (tmp_path / "logs" / "digits" / "sync_manifest.json").is_file()
