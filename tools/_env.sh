# Shared by tools/test and tools/demo: create (once) and activate the venv.
# SYNC_REPLICAS_VENV picks another location; SYNC_REPLICAS_TF picks the
# TensorFlow requirement (default: the CPU build, half the download), or
# several separated by spaces, e.g. 'tensorflow-cpu==2.15.* numpy<2';
# SYNC_REPLICAS_PYTHON the interpreter that creates the venv (default:
# python3; .ci/run passes a Python 3.13 for TensorFlow 2.21).
# What is installed, whichever tool comes first (the demo, check or test):
# the package in editable mode with its test and examples extras, and
# tf_keras; one state, so that no tool reinstalls what another made. pip's
# output (setuptools' editable-install notice among it) goes to
# $venv/.sync_replicas-install.log, shown only when the install fails.
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
extras=test,examples
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
if [ "$installed" != "$want" ]; then
  log="$venv/.sync_replicas-install.log"
  echo "tools: installing $tf_req and sync_replicas[$extras] into $venv" \
    "(a few minutes the first time; pip's output: $log)" >&2
  pip_quiet() {
    if ! "$venv/bin/python" -m pip install -q "$@" >> "$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "tools: pip install $* failed; all of its output: $log" >&2
      exit 1
    fi
  }
  : > "$log"
  pip_quiet --upgrade pip
  pip_quiet "${tf_reqs[@]}" -e "$root[$extras]"
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
  pip_quiet --no-deps "tf_keras==$tf_minor.*"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
cd "$root"
