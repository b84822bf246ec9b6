"""The opt-in patch: stock's ``SyncReplicasOptimizer`` names point to ours.

Owns the one place where the package touches stock's names, and only when
asked: ``install()`` replaces TensorFlow's ``SyncReplicasOptimizer`` with
``sync_replicas.SyncReplicasOptimizer`` wherever a program can reach it,
``uninstall()`` puts stock's back. Nothing is patched by ``import
sync_replicas`` or ``import sync_replicas.patch``.

What it replaces and what it leaves is :data:`SCOPE`, the one text that
``--help`` and docs/patch.md show.
"""

import importlib
import importlib.abc
import logging
import sys
import threading
import types
import typing

logger = logging.getLogger(__name__)

#: What the patch replaces and what it leaves; shown by the runner's
#: ``--help`` and, word for word, by docs/patch.md (a test checks).
SCOPE = """\
What is replaced, as soon as the program imports TensorFlow:
  tf.compat.v1.train.SyncReplicasOptimizer, which is also
    tf.train.SyncReplicasOptimizer after `import tensorflow.compat.v1 as tf`
    and tf.compat.v2.compat.v1.train.SyncReplicasOptimizer;
  tensorflow.python.training.sync_replicas_optimizer.SyncReplicasOptimizer,
    which tf_slim.learning.train(sync_optimizer=...) checks with isinstance,
    so tf-slim's own training loop accepts ours as written (the module's
    names for stock's own code keep stock's class);
  any other TensorFlow module holding stock's class, found by a scan
    (TensorFlow's internal tensorflow.python.training.training).
What is not replaced:
  stock's private _SyncReplicasOptimizerHook (ours makes its own hook in
    make_session_run_hook);
  stock objects created before the patch, and names a program's own module
    bound before the patch (logged as a warning, naming the module).
A TensorFlow whose layout the patch does not know is refused with an error
naming its version, and nothing stays patched. While patched,
isinstance(opt, tf.compat.v1.train.SyncReplicasOptimizer) is true for ours,
and sync_replicas.patch.stock_class() is stock's class, for side by side.
"""

#: The attribute that every home of stock's class binds it to.
_NAME = "SyncReplicasOptimizer"

#: Attribute paths a program uses to reach the class, checked after the
#: patch: (module name in sys.modules, dotted attributes below it, required).
_ACCESS_PATHS = (
    ("tensorflow", "compat.v1.train", True),
    ("tensorflow.compat.v1", "train", True),
    ("tensorflow", "compat.v2.compat.v1.train", False),
)

_lock = threading.RLock()
#: While installed: stock's class, then (what was patched, how to undo it)
#: for each change in the order made. Empty while not installed.
_state: "dict[str, typing.Any]" = {}


class UnknownLayoutError(RuntimeError):
  """This TensorFlow keeps stock's class where the patch does not know."""


class Installation:
  """What ``install()`` returns; a context manager that undoes it.

  Leaving the ``with`` block uninstalls only when this call installed the
  patch, so a ``with install():`` inside a program that was already patched
  (by the runner, say) leaves it patched.
  """

  def __init__(self, *, installed_here: bool) -> None:
    self.installed_here = installed_here

  def __enter__(self) -> "Installation":
    return self

  def __exit__(self, *exc_info: object) -> "typing.Literal[False]":
    if self.installed_here:
      uninstall()
    return False


class _ModuleWithOurs(types.ModuleType):
  """Stock's defining module as programs see it while patched.

  Stock's own ``__init__`` calls ``super(SyncReplicasOptimizer, self)``, a
  look-up in its module's globals: replacing the class there would break
  stock's constructor, and with it side-by-side use. So the module's own
  namespace keeps stock's class, and every name that reaches the module
  (``sys.modules``, its package's attribute, ``tf_slim.learning``'s global)
  gets this stand-in instead: the module's attributes, but ours for
  ``SyncReplicasOptimizer``.
  """

  def __init__(self, module, ours):
    super().__init__(module.__name__, module.__doc__)
    self.__dict__.update(vars(module))
    self.__dict__[_NAME] = ours
    self.__dict__["_sync_replicas_stock_module"] = module

  def __getattr__(self, name):  # Names the module gains later.
    return getattr(self.__dict__["_sync_replicas_stock_module"], name)


def is_installed() -> bool:
  """True while stock's names point to ours."""
  return bool(_state)


def stock_class() -> type:
  """Stock's ``SyncReplicasOptimizer``, patched or not (for side by side)."""
  with _lock:
    if _state:
      return _state["stock"]
    return getattr(_stock_module(), _NAME)


def replaced() -> "list[str]":
  """Where ``SyncReplicasOptimizer`` is ours now: module names, in order."""
  with _lock:
    return [where for where, _ in _state.get("changes", [])
            if not where.startswith("(module) ")]


def install() -> Installation:
  """Points every TensorFlow name of stock's class to ours; idempotent.

  Imports TensorFlow (and ``tensorflow.compat.v1``) if not yet imported.

  Returns:
    An :class:`Installation`, usable as ``with sync_replicas.patch.install():``.

  Raises:
    UnknownLayoutError: this TensorFlow keeps stock's class elsewhere than
      the patch knows; nothing was left patched.
  """
  with _lock:
    if _state:
      return Installation(installed_here=False)
    # Loads the whole public API, so that every generated module that holds
    # the class exists before the scan.
    importlib.import_module("tensorflow.compat.v1")
    ours = importlib.import_module(
        "sync_replicas.optimizer").SyncReplicasOptimizer
    module = _stock_module()
    stock = getattr(module, _NAME, None)
    holders = _tensorflow_holders(stock, module)
    _check_layout(stock, holders)
    _state.update(stock=stock, changes=[])
    stand_in = _ModuleWithOurs(module, ours)
    _change(sys.modules, module.__name__, stand_in, item=True)
    for holder, attribute in _references_to(module):
      _change(holder, attribute, stand_in)
    for holder in holders:
      _change(holder, _NAME, ours)
    unpatched = _unpatched_paths(ours) + [
        getattr(h, "__name__", repr(h))
        for h in _tensorflow_holders(stock, module)]
    if unpatched:
      uninstall()
      raise UnknownLayoutError(
          "sync_replicas.patch does not know TensorFlow %s's layout: after "
          "the patch, stock's SyncReplicasOptimizer is still reached through "
          "%s. Nothing is patched. Import sync_replicas.SyncReplicasOptimizer "
          "in the script instead, or use a TensorFlow from 2.15 to 2.21."
          % (_tf_version(), ", ".join(unpatched)))
    _warn_about_early_bindings(stock)
    # Said where it shows: once the program builds one (``built``).
    logger.debug("Stock's SyncReplicasOptimizer is sync_replicas' now, in "
                 "%s.", ", ".join(replaced()))
    return Installation(installed_here=True)


def built() -> None:
  """Says, once per installation, that the program built ours while patched.

  The optimizer calls it from its constructor while ``is_installed()``: a
  program run unchanged reaches ours through stock's names, and this INFO
  line (the runner shows it on stderr) is what tells the two apart. It
  names where stock's name now gives ours.
  """
  with _lock:
    if not _state or _state.get("said"):
      return
    _state["said"] = True
    where = replaced()
  logger.info("the program's SyncReplicasOptimizer is sync_replicas."
              "SyncReplicasOptimizer: stock's name gives ours in %s "
              "(docs/patch.md)", ", ".join(where))


def uninstall() -> None:
  """Puts stock's class back everywhere ``install()`` put ours; idempotent."""
  with _lock:
    changes = _state.get("changes", [])
    while changes:
      _, undo = changes.pop()
      undo()
    _state.clear()


def _change(holder, name, value, *, item=False):
  """Sets ``holder.name`` (or ``holder[name]``) and records how to undo it."""
  if item:
    old = holder[name]
    holder[name] = value
    where = name
    undo = lambda: holder.__setitem__(name, old)
  else:
    old = getattr(holder, name)
    setattr(holder, name, value)
    where = getattr(holder, "__name__", repr(holder))
    if name != _NAME:
      where = "(module) %s.%s" % (where, name)
    undo = lambda: setattr(holder, name, old)
  _state["changes"].append((where, undo))


def _stock_module():
  compat = importlib.import_module("sync_replicas._compat")
  try:
    return importlib.import_module(compat.STOCK_SYNC_REPLICAS_MODULE)
  except ImportError as e:
    raise UnknownLayoutError(
        "sync_replicas.patch does not know TensorFlow %s's layout: stock's "
        "SyncReplicasOptimizer module %s cannot be imported (%s). Nothing is "
        "patched." % (_tf_version(), compat.STOCK_SYNC_REPLICAS_MODULE, e)
    ) from e


def _loaded_modules():
  """``(name, namespace)`` of every loaded module, each object once."""
  seen = set()
  for name, module in list(sys.modules.items()):
    namespace = getattr(module, "__dict__", None)
    if id(module) not in seen and isinstance(namespace, dict):
      seen.add(id(module))
      yield name, module, namespace


def _tensorflow_holders(stock, defining_module):
  """Every TensorFlow module but the defining one holding stock's class.

  A TensorFlow API module may be a wrapper object rather than a module; its
  own ``setattr`` updates what it wraps and its cache, so the wrapper is what
  is patched.
  """
  return [module for name, module, namespace in _loaded_modules()
          if (name == "tensorflow" or name.startswith("tensorflow."))
          and module is not defining_module
          and namespace.get(_NAME) is stock]


def _references_to(module):
  """``(holder, attribute)`` for every loaded module's name for ``module``.

  Its package's attribute, and globals such as ``tf_slim.learning``'s
  ``sync_replicas_optimizer``.
  """
  return [(holder, attribute)
          for _, holder, namespace in _loaded_modules()
          for attribute, value in list(namespace.items())
          if value is module and holder is not module]


def _check_layout(stock, holders):
  """Raises before anything is patched unless both known homes hold stock."""
  compat = importlib.import_module("sync_replicas._compat")
  names = {getattr(h, "__name__", "") for h in holders}
  if not isinstance(stock, type) or (
      compat.STOCK_SYNC_REPLICAS_API_MODULE not in names):
    raise UnknownLayoutError(
        "sync_replicas.patch does not know TensorFlow %s's layout: expected "
        "stock's SyncReplicasOptimizer class in %s and %s, found %r and %s. "
        "Nothing is patched. Import sync_replicas.SyncReplicasOptimizer in "
        "the script instead, or use a TensorFlow from 2.15 to 2.21."
        % (_tf_version(), compat.STOCK_SYNC_REPLICAS_MODULE,
           compat.STOCK_SYNC_REPLICAS_API_MODULE, stock,
           sorted(names) or "no other module"))


def _unpatched_paths(ours):
  """The access paths a program uses that do not give ours."""
  compat = importlib.import_module("sync_replicas._compat")
  wrong = []
  for root, dotted, required in _ACCESS_PATHS + (
      (compat.STOCK_SYNC_REPLICAS_MODULE, "", True),):
    node = sys.modules.get(root)
    for attribute in filter(None, dotted.split(".")):
      node = getattr(node, attribute, None)
    value = getattr(node, _NAME, None)
    if (value is None and required) or (value is not None and value is not ours):
      wrong.append(".".join(filter(None, (root, dotted, _NAME))))
  return wrong


def _warn_about_early_bindings(stock):
  """Logs the program's modules that bound stock's class before install()."""
  early = sorted(
      name for name, _, namespace in _loaded_modules()
      if not name.startswith(("tensorflow", "sync_replicas"))
      and any(value is stock for value in list(namespace.values())))
  if early:
    logger.warning(
        "%s bound stock's SyncReplicasOptimizer before "
        "sync_replicas.patch.install() and keep it; install the patch before "
        "importing them, or run the program with `python -m "
        "sync_replicas.patch`.", ", ".join(early))


def _tf_version():
  return getattr(sys.modules.get("tensorflow"), "__version__", "(unknown)")


class _InstallAfterTensorFlow(importlib.abc.MetaPathFinder):
  """Installs the patch as soon as ``import tensorflow`` has finished.

  The runner uses it so that a program's code before its own ``import
  tensorflow`` (environment variables TensorFlow reads once, at import) runs
  first, as under ``python SCRIPT``.
  """

  def find_spec(self, fullname, path, target=None):
    if fullname != "tensorflow":
      return None
    sys.meta_path.remove(self)  # One-shot; and the search below skips it.
    for finder in sys.meta_path:
      spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path,
                                                           target)
      if spec is not None and spec.loader is not None:
        spec.loader = _ThenInstall(spec.loader)
        return spec
    return None


class _ThenInstall(importlib.abc.Loader):
  """A loader that runs TensorFlow's own, then ``install()``."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    install()

  def __getattr__(self, name):
    return getattr(self._loader, name)


def install_when_tensorflow_is_imported() -> None:
  """``install()`` now if TensorFlow is loaded, else right after its import."""
  if "tensorflow" in sys.modules:
    install()
  elif not any(isinstance(f, _InstallAfterTensorFlow) for f in sys.meta_path):
    sys.meta_path.insert(0, _InstallAfterTensorFlow())
