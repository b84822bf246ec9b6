"""The profilers: tools/profile_fused.py and tools/profile_ps.

tools/profile_fused.py runs once at its smallest with the fastest options
(prefetched reads, whose copies are local variables, and a chief loop that
must end with the worker's last step). tools/profile_ps's recording needs
perf and a cluster (docs/benchmarks.md has the run); here the parts that turn
perf's output into CPU per update are checked on known input: the lines
``perf script -F time,ip,sym,dso --ns`` prints (in the format of a real
recording of a ps), the category of each function, and the measured window
on the workers' step records.
"""

import json
import pathlib
import subprocess
import sys

import pytest

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Samples of the kinds a bench ps's recording holds (mlp, W = 2), and one
#: of perf's unresolved ones.
_LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
_CC = "/x/libtensorflow_cc.so.2"
_FW = "/x/libtensorflow_framework.so.2"
_PY = "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0"
#: (time, ip, function, library) as perf prints them.
_SAMPLES = [
    ("23462.333932670", "ffffffff815d2e66", "tcp_sendmsg_locked",
     "[kernel.kallsyms]"),
    ("23462.333942670", "ffffffff815d2e67", "finish_task_switch.isra.0",
     "[kernel.kallsyms]"),
    ("23462.333952670", "ffffffff815d2e68", "clear_page_erms",
     "[kernel.kallsyms]"),
    ("23462.333962670", "7f2d674fa8b0",
     "Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>::GlobalSteal()",
     _FW),
    ("23462.334021785", "7fe6292100c2", "__memmove_avx_unaligned_erms",
     _LIBC),
    ("23462.335211470", "7f2d674fa8b4",
     "grpc_core::chttp2::TransportFlowControl::UpdateAction("
     "grpc_core::chttp2::FlowControlAction)", _FW),
    ("23462.336387884", "7f2d674fa8b5",
     "tensorflow::grpc::EncodeTensorToByteBuffer(bool, tensorflow::Tensor "
     "const&, bool, grpc::ByteBuffer*)", _CC),
    ("23462.337469088", "7f2d674fa8b6",
     "tensorflow::ConditionalAccumulator<Eigen::ThreadPoolDevice, float>::"
     "AddToAccumGradFunction(tensorflow::OpKernelContext*, "
     "tensorflow::Tensor const*)", _CC),
    ("23462.338469088", "7f2d674fa8b7",
     "Eigen::internal::TensorExecutor<Eigen::TensorAssignOp<float>, "
     "Eigen::ThreadPoolDevice, true, (Eigen::internal::TiledEvaluation)0>"
     "::run", _CC),
    ("23462.339469088", "7f2d674fa8b8",
     "tensorflow::(anonymous namespace)::ExecutorState<tensorflow::"
     "PropagatorState>::Process(tensorflow::PropagatorState::TaggedNode, "
     "long)", _FW),
    ("23462.340469088", "7f2d674fa8b9", "_int_malloc", _LIBC),
    ("23462.341469088", "7f2d674fa8ba",
     "Eigen::bfloat16_impl::float_to_bfloat16_rtne<false>(float)", _CC),
    ("23462.342469088", "7f2d674fa8bb", "_PyEval_EvalFrameDefault", _PY),
    ("23462.343469088", "7f2d674fa8bc", "[unknown]", "[unknown]"),
    ("23462.344469088", "7f2d674fa8bd",
     "google::protobuf::io::CodedOutputStream::WriteVarint32SlowPath("
     "unsigned int)", _FW),
]
#: The samples in ``perf script -F time,ip,sym,dso --ns``'s layout, and a
#: line that is not a sample.
SCRIPT = "\n".join(
    [" %s: %18s %s (%s)" % s for s in _SAMPLES] + ["not a sample line"])


@pytest.fixture(name="tool")
def _tool():
  return support.load_tool("profile_ps")


@pytest.mark.version_independent
def test_every_sample_line_is_parsed_with_its_time_function_and_library(
    tool):
  samples = tool.parse_script(SCRIPT)
  assert len(samples) == 15
  assert samples[0] == (23462.33393267, "tcp_sendmsg_locked",
                        "[kernel.kallsyms]")
  # A demangled C++ function keeps its parentheses; the library is the last
  # parenthesized group.
  assert samples[6][1].startswith("tensorflow::grpc::EncodeTensorToByteBuffer(")
  assert samples[6][2] == "/x/libtensorflow_cc.so.2"
  assert samples[13][1:] == ("[unknown]", "[unknown]")


@pytest.mark.version_independent
def test_each_function_falls_in_the_category_its_cost_belongs_to(tool):
  names = [tool.category(symbol, dso)
           for _, symbol, dso in tool.parse_script(SCRIPT)]
  assert names == ["kernel: network", "kernel: scheduling", "kernel: other",
                   "thread pools", "copies", "grpc", "serialization",
                   "accumulators", "math", "runtime", "allocation", "casts",
                   "python", "other", "serialization"]
  assert set(names) <= set(tool.NAMES)


@pytest.mark.version_independent
def test_only_samples_in_the_window_count_each_worth_its_period(tool):
  samples = tool.parse_script(SCRIPT)
  # 1000 samples a second: each is 1 ms of CPU; over 2 updates, 0.5 ms.
  by_category, by_function = tool.split(
      samples, 23462.3340, 23462.3375, 1000, 2)
  assert by_category == pytest.approx(
      {"copies": 0.5, "grpc": 0.5, "serialization": 0.5,
       "accumulators": 0.5})
  assert sum(by_function.values()) == pytest.approx(2.0)


@pytest.mark.version_independent
def test_the_window_opens_after_every_worker_s_first_step_and_warmup(tool):
  chief = {"steps_at": [[10.0, 1], [11.0, 3], [12.5, 5], [13.0, 7],
                        [14.0, 9]]}
  other = {"steps_at": [[10.5, 2], [12.0, 4]]}
  # Both workers stepped by 10.5; 2 s later the window opens at the chief's
  # step at 12.5 and runs to its last.
  assert tool.window([chief, other], 2.0) == (12.5, 14.0, 4)
  with pytest.raises(ValueError, match="give --secs more than --warmup"):
    tool.window([chief, other], 3.5)


@pytest.mark.version_independent
def test_a_slow_perf_script_names_the_option_to_raise(tool, tmp_path):
  """perf script outlasted the default 300 s beside other work: the error
  says to pass --run-timeout, and a value (the bound here is far shorter
  than any process start)."""
  recording = tmp_path / "ps.perf"
  recording.write_bytes(b"\0" * 1000)
  with pytest.raises(RuntimeError,
                     match=r"within 1e-06 s \(--run-timeout\).*"
                     r"run again with --run-timeout 1200 or more"):
    tool.script_samples(recording, timeout=1e-6)


def test_profile_fused_profiles_prefetched_reads_to_the_last_step(tmp_path):
  """Every option set profiles to its end: the chief's loop runs one sync
  op per step (none left waiting), prefetch's local copies are
  initialized, and the tensors crossing are counted from the traces."""
  out = tmp_path / "profile.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "profile_fused.py"),
       "--scenario", "small", "--steps", "3", "--warmup", "2",
       "--variant", 'default={}', "--variant",
       'fastest={"fuse_dense_gradients": true, '
       '"prefetch_variable_reads": true, "transfer_dtype": "bfloat16"}',
       "--json", str(out)],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert sorted(results) == ["default", "fastest"]
  for result in results.values():
    assert result["cpu_ms_per_step"] > 0, result
  # The 10 reads cross as one prefetched tensor with the token, the 10
  # gradients as one fused push (the traces count 11 tensors, and 2).
  received = {name: (r["op_micros"]["train/worker/tensors received"],
                     r["op_micros"]["train/ps/tensors received"])
              for name, r in results.items()}
  assert received["fastest"][0] < 5 < received["default"][0], received
  assert received["fastest"][1] < 5 < received["default"][1], received
