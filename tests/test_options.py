"""The options as one frozen, checked value: ``optimizer.options`` (issue 17)."""

import dataclasses

import pytest
import tensorflow as tf

import support
from sync_replicas import _options


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


def test_default_options_are_stock_but_for_the_documented_three():
  o = _options.make(2, 2, **{f.name: f.default
                             for f in dataclasses.fields(_options.Options)
                             if f.name in _options.EXTRAS})
  assert o == _options.Options(2, 2)
  assert not o.has_deadline and o.tokens_per_step == 2
  assert (o.prompt_stop, o.stall_log_secs, o.pack_gradient_transfers) == (
      True, 60.0, True)
