# Shared by tools/test and tools/demo: create (once) and activate the venv.
# SYNC_REPLICAS_VENV picks another location; SYNC_REPLICAS_TF picks the
# TensorFlow requirement (default: the CPU build, half the download), or
# several separated by spaces, e.g. 'tensorflow-cpu==2.15.* numpy<2';
# SYNC_REPLICAS_PYTHON the interpreter that creates the venv (default:
# python3; .ci/run passes a Python 3.13 for TensorFlow 2.21).
# What is installed: tools/test needs the test and examples extras and
# tf_keras; tools/demo sets sync_replicas_env_for=demo before sourcing this
# and gets only what the demo needs, the examples extra. A venv installed
# for the tests serves the demo as it is.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SYNC_REPLICAS_VENV:-$root/.venv}"
# Made absolute (CI passes .venv-215): "$venv/bin" goes first on PATH, and a
# relative entry there makes sys.executable relative, which a test's child
# started in another directory, or as another user (test_confine), cannot
# find.
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
tf_req="${SYNC_REPLICAS_TF:-tensorflow-cpu>=2.15,<2.22}"
read -r -a tf_reqs <<< "$tf_req"
stamp="$venv/.sync_replicas-installed"
if [ "${sync_replicas_env_for:-test}" = demo ]; then
  extras=examples
else
  extras=test,examples
fi
# Reinstall when the requirement, the extras, the package's metadata or this
# script changes.
sums="$(cksum < "$root/setup.cfg")|$(cksum < "${BASH_SOURCE[0]}")"
want="$tf_req|$extras|$sums"
installed="$(cat "$stamp" 2>/dev/null || true)"
if [ ! -x "$venv/bin/python" ]; then
  python="${SYNC_REPLICAS_PYTHON:-python3}"
  echo "tools: creating $venv with $python ($("$python" --version 2>&1))" >&2
  "$python" -m venv "$venv"
fi
if [ "$installed" != "$want" ] \
    && [ "$installed" != "$tf_req|test,examples|$sums" ]; then
  echo "tools: installing $tf_req and sync_replicas[$extras] into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  if [ "$extras" = examples ]; then
    # The demo's: a plain install, not an editable one, whose build warns
    # (setuptools, flat layout) on a newcomer's first run. The demo runs
    # from the clone's root, where the clone's own package comes first.
    package=("$root[$extras]")
  else
    package=(-e "$root[$extras]")
  fi
  "$venv/bin/python" -m pip install -q "${tf_reqs[@]}" "${package[@]}" >&2
  if [ "$extras" = test,examples ]; then
    # tf_keras (the keras2 extra, for tests/test_keras.py) must match
    # TensorFlow's minor version, and it requires the full `tensorflow`
    # package: installed by its own, without dependencies, so that it sits
    # on the tensorflow-cpu just installed instead of pulling a second
    # TensorFlow.
    tf_minor="$("$venv/bin/python" -c '
import importlib.metadata as md
for name in ("tensorflow-cpu", "tensorflow"):
  try:
    print(".".join(md.version(name).split(".")[:2]))
    break
  except md.PackageNotFoundError:
    pass
')"
    if [ -z "$tf_minor" ]; then
      echo "tools: no TensorFlow in $venv after installing $tf_req" >&2
      exit 1
    fi
    "$venv/bin/python" -m pip install -q --no-deps "tf_keras==$tf_minor.*" >&2
  fi
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
cd "$root"
