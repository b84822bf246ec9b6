"""The options as one frozen, checked value: ``optimizer.options`` (issue 17)."""

import ast
import dataclasses
import inspect
import pathlib
import re

import pytest
import tensorflow as tf

import support
from sync_replicas import _gone
from sync_replicas import _options
from sync_replicas import _prefetch
from sync_replicas import _rewired_reads
from sync_replicas import _transfer


def test_options_echo_the_constructor_and_derive_once(graph):
  del graph
  avg = tf.train.ExponentialMovingAverage(0.9)
  opt = support.OURS(
      support.sgd(), replicas_to_aggregate=3, total_num_replicas=4,
      variable_averages=avg, variables_to_average=[], statistics=1,
      statistics_log_steps=None, sparse_reduction="sum",
      one_gradient_per_worker=True, worker_index=2,
      min_replicas_to_aggregate=2, aggregation_deadline_secs=1.5)
  o = opt.options
  assert (o.replicas_to_aggregate, o.total_num_replicas) == (3, 4)
  assert o.variable_averages is avg and o.variables_to_average == []
  # Flags are bools, None log steps mean never (0), and a sum over rows
  # implies combined duplicates.
  assert o.statistics is True and o.statistics_log_steps == 0
  assert o.sparse_reduction == "sum" and o.combine_sparse_duplicates is True
  assert (o.one_gradient_per_worker, o.worker_index) == (True, 2)
  assert (o.min_replicas_to_aggregate, o.aggregation_deadline_secs) == (2, 1.5)
  assert o.has_deadline and o.tokens_per_step == 4 == opt.tokens_per_step
  assert o.pack_gradient_transfers and o.prompt_stop
  with pytest.raises(dataclasses.FrozenInstanceError):
    o.statistics = False  # type: ignore[misc]


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "options.md"


def _documented_defaults():
  """option -> default, from the table at the top of docs/options.md."""
  documented = {}
  lines = DOCS.read_text().splitlines()
  start = lines.index("| option | default | what it changes | where |")
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    names, defaults = [re.findall(r"`([^`]+)`", cell)
                       for cell in line.split("|")[1:3]]
    assert len(names) == len(defaults), line
    documented.update(zip(names, map(ast.literal_eval, defaults),
                                strict=True))
  return documented


def test_the_constructors_defaults_are_the_documented_ones(graph,
                                                           monkeypatch):
  del graph
  monkeypatch.delenv(_rewired_reads.ENV, raising=False)
  monkeypatch.delenv(_transfer.ENV, raising=False)
  monkeypatch.delenv(_prefetch.ENV, raising=False)
  monkeypatch.delenv(_gone.ENV, raising=False)
  documented = _documented_defaults()
  params = inspect.signature(support.OURS.__init__).parameters.values()
  keyword_only = {p.name: p.default for p in params
                  if p.kind is inspect.Parameter.KEYWORD_ONLY}
  # Every option is in the table, with the constructor's default.
  assert keyword_only == documented
  # The options an optimizer built without any gets are those defaults;
  # pack_variable_reads' and prefetch_variable_reads' None read their
  # environment variables, unset: off.
  o = support.OURS(support.sgd(), replicas_to_aggregate=2).options
  assert {k: getattr(o, k) for k in documented} == dict(
      documented, pack_variable_reads=False, prefetch_variable_reads=False)
  # Stock's own arguments keep stock's names, order and defaults.
  stock = inspect.signature(support.STOCK.__init__).parameters.values()
  assert [(p.name, p.default) for p in params
          if p.kind is not inspect.Parameter.KEYWORD_ONLY] == [
              (p.name, p.default) for p in stock]


def test_default_options_are_stock_but_for_the_documented_four(graph):
  del graph
  o = support.OURS(support.sgd(), replicas_to_aggregate=2).options
  assert o == _options.Options(2, 2)
  assert not o.has_deadline and o.tokens_per_step == 2
  different = {k: getattr(o, k) for k in ("prompt_stop", "stall_log_secs",
                                           "pack_gradient_transfers",
                                           "data_end")}
  assert different == dict(prompt_stop=True, stall_log_secs=60.0,
                           pack_gradient_transfers=True, data_end="train_all")
  # Each of the four, switched to stock's behaviour, is still a valid value.
  support.OURS(support.sgd(), replicas_to_aggregate=2, prompt_stop=False,
               stall_log_secs=None, pack_gradient_transfers=False,
               data_end="stock")


@pytest.mark.parametrize("value,words", [
    (0, "worker_gone_secs must be a number of seconds > 0, got 0"),
    (-1.5, "got -1.5"),
    (True, "got True"),
    ("5", "got '5'"),
    (float("nan"), "got nan"),
])
def test_worker_gone_secs_refuses_what_is_not_seconds(graph, value, words):
  del graph
  with pytest.raises(ValueError, match=re.escape(words)) as e:
    support.OURS(support.sgd(), replicas_to_aggregate=2,
                 worker_gone_secs=value)
  assert "or None (the default) to wait for it" in str(e.value)


def test_worker_gone_secs_needs_train_all_and_reads_its_variable(
    graph, monkeypatch):
  del graph
  with pytest.raises(ValueError, match=re.escape(
      "worker_gone_secs=5 needs data_end=\"train_all\" (the default), got "
      "data_end='stop_together'")):
    support.OURS(support.sgd(), replicas_to_aggregate=2, worker_gone_secs=5,
                 data_end="stop_together")
  monkeypatch.setenv(_gone.ENV, "2.5")
  assert support.OURS(support.sgd(), replicas_to_aggregate=2).options == (
      _options.Options(2, 2, worker_gone_secs=2.5))
  # The argument wins over the environment.
  assert support.OURS(support.sgd(), replicas_to_aggregate=2,
                      worker_gone_secs=7).options.worker_gone_secs == 7.0
  monkeypatch.setenv(_gone.ENV, "soon")
  with pytest.raises(ValueError, match=re.escape(
      "%s must be a number of seconds > 0, got 'soon'" % _gone.ENV)):
    support.OURS(support.sgd(), replicas_to_aggregate=2)
  # With data_end="stock" the variable is refused as clearly.
  monkeypatch.setenv(_gone.ENV, "3")
  with pytest.raises(ValueError, match="SYNC_REPLICAS_WORKER_GONE_SECS=3.0 "
                     "needs data_end"):
    support.OURS(support.sgd(), replicas_to_aggregate=2, data_end="stock")
