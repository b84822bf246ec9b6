"""The token queue: the barrier that paces every worker.

Owns the ``sync_token_q`` FIFOQueue on the global step's device, the chief's
per-update enqueue of ``tokens_per_step`` copies of the new global step, the
worker's dequeue, the one-off init-tokens op and the drains of a restarted
chief; and the two token policies (``SharedTokens``, stock's;
``PerWorkerTokens``, ``one_gradient_per_worker``) that own all of these for a
built optimizer. When to drain is ``_restart``'s to say.
"""

import tensorflow as tf

#: Stock's graph and shared name for the token queue.
TOKEN_QUEUE_NAME = "sync_token_q"
#: The optimizer name whose shared names are stock's, unprefixed.
DEFAULT_OPTIMIZER_NAME = "sync_replicas"


def shared_prefix(optimizer_name):
  """What the optimizer's shared names start with.

  Stock gives every instance the same shared names, so two sync optimizers
  in one job (a GAN's generator and discriminator, say) share one token queue
  and steal each other's tokens. With the default name ours keeps stock's
  names; any other name prefixes them, giving each optimizer its own queue.
  """
  if optimizer_name == DEFAULT_OPTIMIZER_NAME:
    return ""
  return optimizer_name + "/"


def tokens_per_step(replicas_to_aggregate, total_num_replicas):
  """Tokens the chief releases after each update.

  With backups (total > aggregate) every replica gets one; in multi-batch mode
  (total < aggregate) there must be enough for the workers to deliver
  ``replicas_to_aggregate`` gradients between them.
  """
  return max(total_num_replicas, replicas_to_aggregate)


def create_queue(dtype, *, shared_name=TOKEN_QUEUE_NAME):
  """Creates the token queue; call under the global step's device, root scope.

  The chief's QueueRunner runs on this queue, so stopping the coordinator
  closes it and wakes every worker blocked in ``dequeue`` with OutOfRange.
  """
  return tf.queue.FIFOQueue(
      -1, dtype, shapes=(), name=TOKEN_QUEUE_NAME, shared_name=shared_name)


def fill_op(token_queue, global_step, count, *, encode):
  """Enqueues ``count`` copies of the current global step.

  ``encode`` adds the restart generation (see ``_restart``) to the tokens;
  the fill itself keeps stock's op names.
  """
  tokens = encode(tf.fill([count], global_step))
  return token_queue.enqueue_many((tokens,))


#: Graph and shared name of a worker's own token queue (one_gradient_per_worker).
WORKER_QUEUE_NAME = TOKEN_QUEUE_NAME + "_worker_%d"


def create_worker_queues(dtype, count, *, shared_prefix):
  """One token queue per worker, for ``one_gradient_per_worker``.

  Stock's single queue lets a fast worker take a second token of the same
  step (the chief releases ``total_num_replicas`` of them) and push a second
  gradient into the same update. Here every worker takes tokens only from its
  own queue, which gets one token per update, and skips tokens no newer than
  the step it just pushed at (``newer_token``): its pushes carry strictly
  increasing local steps, so at most one of them is fresh for an update.

  Call under the global step's device, in the optimizer's own name scope.
  """
  return [tf.queue.FIFOQueue(-1, dtype, shapes=(),
                             name=WORKER_QUEUE_NAME % i,
                             shared_name=shared_prefix + WORKER_QUEUE_NAME % i)
          for i in range(count)]


def fill_each_op(queues, global_step, *, encode):
  """Enqueues one copy of the current global step into every worker queue."""
  token = encode(tf.convert_to_tensor(global_step))
  return tf.group(*[q.enqueue(token) for q in queues],
                  name="release_worker_tokens")


def newer_token(queue, first, pushed_at):
  """Dequeues from ``queue`` until a token is newer than ``pushed_at``.

  A worker's first push needs no token (its local step starts at the global
  step), so the tokens of that step, and those a stopped worker's queue
  piled up while it was away, are skipped instead of letting it push at a
  step it already pushed at. Only the worker's own queue is read: skipping
  takes nothing from any other worker.

  Args:
    queue: The worker's own token queue.
    first: The token already dequeued.
    pushed_at: The local step this worker's gradients were pushed with.

  Returns:
    The first token greater than ``pushed_at``.
  """
  (token,) = tf.compat.v1.while_loop(
      lambda token: token <= pushed_at, lambda token: (queue.dequeue(),),
      (first,), back_prop=False, return_same_structure=True,
      name="skip_old_tokens")
  return token


class SharedTokens:
  """Stock's token policy: every worker takes from one ``sync_token_q``.

  Owns the queues' creation, a worker's take, the chief's release after
  each update, the initial fill, the drains of a restarted chief and the
  close on stop. ``PerWorkerTokens`` is the other policy.

  Made with the optimizer (``check_num_tokens`` works before the build);
  ``create`` builds the queues and must come before the other methods.

  Args:
    shared_prefix: What the queues' shared names start with
      (``shared_prefix(name)``).
    tokens_per_step: Tokens released after each update.
  """

  def __init__(self, *, shared_prefix, tokens_per_step):
    self._prefix = shared_prefix
    self._scope = self._device = None
    self._tokens_per_step = tokens_per_step
    self.shared_name = shared_prefix + TOKEN_QUEUE_NAME
    self.token_queue = None

  @property
  def queues(self):
    """Every token queue: what the status ops count and a restart drains."""
    return [self.token_queue]

  @property
  def worker_queues(self):
    """The workers' own queues (none with this policy)."""
    return []

  @property
  def worker_shared_names(self):
    """The shared names of ``worker_queues``, for a status reader."""
    return [q.queue_ref.op.get_attr("shared_name").decode()
            for q in self.worker_queues]

  def create(self, global_step, *, scope):
    """Creates ``sync_token_q`` (stock's name) on the global step's device.

    ``scope`` is our own name scope (``<name>_status/``), for our queues.
    """
    self._scope, self._device = scope, global_step.device
    with tf.compat.v1.device(global_step.device), \
        tf.compat.v1.name_scope(""):
      self.token_queue = create_queue(global_step.dtype.base_dtype,
                                      shared_name=self.shared_name)

  def take(self, after, local_step):
    """The worker's token, dequeued once every op of ``after`` ran.

    Call under the global step's device, in the root name scope.
    """
    del local_step  # Any token will do.
    with tf.control_dependencies(after):
      return self.token_queue.dequeue()

  def release(self, global_step, *, encode):
    """The chief's enqueue of one update's tokens (stock's op names)."""
    return fill_op(self.token_queue, global_step, self._tokens_per_step,
                   encode=encode)

  def check_num_tokens(self, num_tokens):
    """Raises if this policy cannot give ``num_tokens`` initial tokens."""
    del num_tokens  # _checks.init_tokens checks the count itself.

  def initial_fill(self, global_step, count, *, encode, after):
    """The init-tokens op: ``count`` tokens, or None for no tokens.

    ``after`` builds (there, in the root scope) the ops the fill follows.
    """
    if count <= 0:
      return None
    with tf.compat.v1.device(global_step.device), \
        tf.compat.v1.name_scope(""), tf.control_dependencies(after()):
      return fill_op(self.token_queue, global_step, count, encode=encode)

  def drain_ops(self, restarted, *, after):
    """The chief's drains: every queue emptied if ``restarted`` is true.

    A restarted chief's queues hold tokens of an earlier generation's steps;
    on a first start they may hold the init tokens, which must stay.

    Args:
      restarted: The bool predicate, read after this start's ``start_op``
        (``_restart.ChiefStart.restarted``, which decides when); one read
        for every drain.
      after: The ops every drain's reads follow (this start's
        ``Generations.start_op``).

    Returns:
      One op per queue in ``queues``, for ``chief_init_op``.
    """
    drains = []
    for queue in self.queues:
      with tf.compat.v1.device(self._device), \
          tf.compat.v1.name_scope(self._scope), \
          tf.control_dependencies(after):
        count = tf.where(restarted, queue.size(), 0)
        drains.append(queue.dequeue_up_to(count, name="drain_tokens").op)
    return drains

  def close_op(self):
    """What the chief's runner closes besides ``sync_token_q``: nothing."""
    return None


class PerWorkerTokens(SharedTokens):
  """``one_gradient_per_worker``: each worker takes from a queue of its own.

  ``sync_token_q`` is still created (stock's name, the runner's queue); the
  workers' queues live in our own scope, get one token per update, and a
  worker skips tokens no newer than the step it pushed at (``newer_token``).
  """

  def __init__(self, *, worker_index, total_num_replicas, **kwargs):
    super().__init__(**kwargs)
    self._worker_index = worker_index
    self._count = total_num_replicas
    self._worker_queues = []

  @property
  def queues(self):
    return [self.token_queue] + self._worker_queues

  @property
  def worker_queues(self):
    return list(self._worker_queues)

  def create(self, global_step, *, scope):
    super().create(global_step, scope=scope)
    with tf.compat.v1.device(global_step.device), \
        tf.compat.v1.name_scope(self._scope):
      self._worker_queues = create_worker_queues(
          global_step.dtype.base_dtype, self._count,
          shared_prefix=self._prefix)

  def take(self, after, local_step):
    own = self._worker_queues[self._worker_index]
    # The step the gradients were pushed with, read outside the dequeue's
    # wait: the local step changes only in the train op's last assign, so
    # it is the same value, and a read made to follow the pushes would have
    # the worker wait for the ps (one control edge per push task) before
    # its dequeue is even sent.
    with tf.compat.v1.name_scope(self._scope):
      pushed_at = tf.identity(local_step)
    with tf.control_dependencies(after):
      token = own.dequeue()
    with tf.compat.v1.name_scope(self._scope):
      return newer_token(own, token, pushed_at)

  def release(self, global_step, *, encode):
    with tf.compat.v1.name_scope(self._scope):
      return fill_each_op(self._worker_queues, global_step, encode=encode)

  def check_num_tokens(self, num_tokens):
    if num_tokens != -1:
      raise ValueError(
          "With one_gradient_per_worker=True the chief gives every worker "
          "exactly one initial token (more would let a worker push twice at "
          "the first step); got num_tokens=%r. Pass -1 (the default)."
          % (num_tokens,))

  def initial_fill(self, global_step, count, *, encode, after):
    # One token of the current step per worker. A worker that starts now
    # pushes at that step without a token and then skips this one
    # (newer_token); one still holding an older step (its chief restarted)
    # needs it to push again, or nobody would.
    del count, after
    with tf.compat.v1.device(global_step.device), \
        tf.compat.v1.name_scope(self._scope):
      return fill_each_op(self._worker_queues, global_step, encode=encode)

  def close_op(self):
    with tf.compat.v1.name_scope(self._scope):
      return tf.group(
          *[q.close(cancel_pending_enqueues=True)
            for q in self._worker_queues],
          name="close_worker_token_queues")


def policy(options, *, shared_prefix):
  """The token policy ``options`` (an ``_options.Options``) ask for."""
  common = dict(shared_prefix=shared_prefix,
                tokens_per_step=options.tokens_per_step)
  if options.one_gradient_per_worker:
    return PerWorkerTokens(worker_index=options.worker_index,
                           total_num_replicas=options.total_num_replicas,
                           **common)
  return SharedTokens(**common)
