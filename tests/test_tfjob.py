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
of this machine with the TF_CONFIG the training operator injects. In the
default run each pod's program only says what it was given (its TF_CONFIG,
where the service names resolve, its arguments and volume) and reaches the
ps by its name; the manifest's own program, which trains to the end, is the
scale tier's (``./tools/test --all``, CI).
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


_NEEDS_ROOT = pytest.mark.skipif(not support.is_machine_root(), reason=(
    "emulated hosts need the machine's root here: /run/netns and /etc/hosts "
    "are mounted over in the rehearsal's own mount namespace"))

#: Each container's program in the rehearsal of what a pod is given: no
#: TensorFlow, only what the pod sees. Its TF_CONFIG and arguments, where
#: each of the job's service names resolves, the chief's --logdir written
#: (a volume's directory), and the ps, serving on its port until stopped,
#: reached by its service name.
_POD_VIEW = r"""
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
name = "%s%d" % (task["type"], task["index"])
print("%s TF_CONFIG=%s" % (name, os.environ["TF_CONFIG"]), flush=True)
print("%s args %s" % (name, " ".join(sys.argv[1:])), flush=True)
for job in sorted(config["cluster"]):
  for address in config["cluster"][job]:
    host = address.rsplit(":", 1)[0]
    print("%s resolves %s to %s" % (name, host, socket.gethostbyname(host)),
          flush=True)
for arg in sys.argv[1:]:
  if arg.startswith("--logdir="):
    logdir = arg.split("=", 1)[1]
    os.makedirs(logdir, exist_ok=True)
    open(os.path.join(logdir, name), "w").close()
if task["type"] == "ps":
  me = config["cluster"]["ps"][task["index"]]
  server = socket.create_server(("", int(me.rsplit(":", 1)[1])))
  print("%s serving" % name, flush=True)
  while True:
    server.accept()[0].close()
host, port = config["cluster"]["ps"][0].rsplit(":", 1)
deadline = time.monotonic() + 60
while True:
  try:
    socket.create_connection((host, int(port)), timeout=5).close()
    break
  except OSError:
    if time.monotonic() > deadline:
      raise
    time.sleep(0.1)
print("%s reached the ps at %s:%s" % (name, host, port), flush=True)
"""


@pytest.mark.timeout(120)
@_NEEDS_ROOT
def test_the_rehearsal_gives_each_pod_the_operators_tf_config_names_and_volumes(
    tmp_path):
  # The manifest as it is but for each container's program, which only
  # says what its pod is given (no TensorFlow): what tools/tfjob itself
  # does, in a few CPU-seconds. The manifest's own program trains in the
  # scale tier's rehearsal below.
  documents = _documents()
  for spec in documents[0]["spec"]["tfReplicaSpecs"].values():
    for container in spec["template"]["spec"]["containers"]:
      container["command"] = ["python", "-c", _POD_VIEW]
  manifest = tmp_path / "tfjob.yaml"
  manifest.write_text(yaml.safe_dump_all(documents))
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "tfjob"), str(manifest),
       "--link-rate", "1gbit", "--volumes", str(tmp_path),
       "--set=--steps=3", "--timeout", "90"], cwd=ROOT,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True,
      text=True, timeout=110)
  text = proc.stdout + proc.stderr
  assert proc.returncode == 0, text[-6000:]
  launched = re.findall(r"\[launch\] (\w+)-(\d) (\S+) at (\S+): TF_CONFIG=(.*)\n",
                        text)
  pods = {"%s%s" % (kind, index): (service, address, config)
          for kind, index, service, address, config in launched}
  assert sorted(pods) == ["chief0", "ps0", "worker0", "worker1",
                          "worker2"], text[:3000]
  assert pods["worker1"][2] == _OPERATORS_WORKER_1
  where = {service: address for service, address, _ in pods.values()}
  assert len(set(where.values())) == 5, where
  for name, (_, _, config) in pods.items():
    # The pod was given the TF_CONFIG the rehearsal says, byte for byte.
    assert "[%s] %s TF_CONFIG=%s\n" % (name, name, config) in text, text
    # Every service name resolves, in every pod, to its pod's host.
    resolved = dict(re.findall(r"^\[%s\] %s resolves (\S+) to (\S+)$" % (
        name, name), text, re.M))
    assert resolved == where, (name, resolved, where)
  args = dict(re.findall(r"^\[(\w+)\] \1 args (.*)$", text, re.M))
  assert args["chief0"] == "--backups=1 --steps=3 --logdir=%s" % (
      tmp_path / "logs" / "digits"), args
  for worker in ("worker0", "worker1", "worker2"):
    assert args[worker] == "--backups=1 --steps=3", args
    assert "[%s] %s reached the ps at sync-replicas-digits-ps-0.default." \
        "svc:2222\n" % (worker, worker) in text, text[-4000:]
    assert "[launch] %s exited 0\n" % worker in text, text[-4000:]
  assert "[chief0] chief0 reached the ps at " in text, text[-4000:]
  assert (tmp_path / "logs" / "digits" / "chief0").is_file()


@pytest.mark.timeout(300)
@_NEEDS_ROOT
@pytest.mark.scale(reason=(
    "the manifest's own program on its pods (about 36 CPU-seconds under "
    "load): what tools/tfjob gives each pod (the operator's TF_CONFIG, the "
    "service names resolving to the pods' hosts, --set, the volumes) is "
    "this file's test_the_rehearsal_gives_each_pod_the_operators_tf_config_"
    "names_and_volumes, every task's command parses with the digits "
    "parser in test_every_task_command_parses_with_the_digits_parser, and "
    "examples.digits trains across emulated hosts from a TF_CONFIG with a "
    "chief job in test_hosts' test_training_on_hosts_survives_a_cut_link_"
    "and_is_read_by_status"))
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
