"""Stand-in for ``inception.slim.slim``: the names the distributed trainer uses.

``scopes.arg_scope`` sets default keyword arguments of the functions marked
with ``add_arg_scope``, as the original did; ``variables.global_step`` is the
original's: an int64 ``global_step`` in GLOBAL_STEP, placed by the device
function given to it; ``VariableDeviceChooser`` places variables round robin
on the ps tasks, as the original. ``losses`` and ``ops`` hold the original's
collection names.
"""

import contextlib
import functools
import types

import tensorflow.compat.v1 as tf

_scope_stack = [{}]


def add_arg_scope(func):
  @functools.wraps(func)
  def wrapper(*args, **kwargs):
    defaults = _scope_stack[-1].get(func.__name__, {})
    return func(*args, **dict(defaults, **kwargs))
  return wrapper


@contextlib.contextmanager
def arg_scope(list_ops, **kwargs):
  current = {name: dict(kw) for name, kw in _scope_stack[-1].items()}
  for op in list_ops:
    current.setdefault(op.__name__, {}).update(kwargs)
  _scope_stack.append(current)
  try:
    yield current
  finally:
    _scope_stack.pop()


class VariableDeviceChooser:
  """Round robin over the ps tasks, as the original's device chooser."""

  def __init__(self, num_parameter_servers=0, ps_device='/job:ps',
               placement='CPU:0'):
    self._num_ps = num_parameter_servers
    self._ps_device = ps_device
    self._placement = placement if num_parameter_servers == 0 else 'CPU:0'
    self._next_task_id = 0

  def __call__(self, op):
    device_string = ''
    if self._num_ps > 0:
      task_id = self._next_task_id
      self._next_task_id = (self._next_task_id + 1) % self._num_ps
      device_string = '%s/task:%d' % (self._ps_device, task_id)
    device_string += '/%s' % self._placement
    return device_string


def _device(device):
  return device(None) if callable(device) else device


@add_arg_scope
def global_step(device=''):
  found = tf.get_collection(tf.GraphKeys.GLOBAL_STEP)
  if found:
    return found[0]
  with tf.device(_device(device)):
    return tf.get_variable(
        'global_step', shape=[], dtype=tf.int64,
        initializer=tf.zeros_initializer(), trainable=False,
        collections=[tf.GraphKeys.GLOBAL_VARIABLES,
                     tf.GraphKeys.GLOBAL_STEP])


@add_arg_scope
def variable(name, shape=None, dtype=tf.float32, initializer=None,
             trainable=True, collections=None, device=''):
  collections = list(collections or []) + [tf.GraphKeys.GLOBAL_VARIABLES]
  with tf.device(_device(device)):
    return tf.get_variable(name, shape=shape, dtype=dtype,
                           initializer=initializer, trainable=trainable,
                           collections=collections)


scopes = types.SimpleNamespace(arg_scope=arg_scope, add_arg_scope=add_arg_scope)
variables = types.SimpleNamespace(
    variable=variable, global_step=global_step,
    VariableDeviceChooser=VariableDeviceChooser)
losses = types.SimpleNamespace(LOSSES_COLLECTION='_losses')
ops = types.SimpleNamespace(UPDATE_OPS_COLLECTION='_update_ops_')
