"""The patches: installed when the first AssignAwareTape is entered, and left
in place, dormant, until ``uninstall()``.

Installing and removing them on every tape cost tens of microseconds per
tape; left in place, each patched function first asks whether any tape is
open (or closed but alive) and, if none is, calls the original straight
away, so code outside every tape runs as plain TensorFlow. ``uninstall()``
puts back the exact original objects:

* ``BaseResourceVariable._handle`` gets a data descriptor that answers with the
  current version (see ``_versions``).
* The Python wrappers of the ops that write variables (``gen_*_ops.<op>``, and
  the same functions as ``tf.raw_ops.<Op>``) get the wrapper ``_writes``
  builds for them: what happens on a write lives there. The raw read ops get
  one too (a kept handle reads the current version).
* A few functions and methods, each wrapped for one topic with its own module:
  see ``_attribute_patches``.

Why the op wrappers and not ``Variable.assign`` and friends: every path to a
write ends in one of these functions (``v.assign``, ``v[1:3].assign``,
``v.scatter_*``, ``tf.compat.v1.assign`` / ``scatter_*``, ``state_ops``, raw ops,
checkpoint restore), and TensorFlow calls them through the module attribute, so
one wrapper per op sees them all.
"""

from __future__ import annotations

import operator
import signal
import sys
from typing import Any, Callable, Dict, List, Tuple

import tensorflow as tf

from assigntape import (
    _compiled_tapes,
    _control_flow,
    _control_gradients,
    _datasets,
    _diagnostics,
    _distribute,
    _functions,
    _fused,
    _graph_gradients,
    _jvp,
    _leases,
    _plain_gradients,
    _plain_tapes,
    _py_functions,
    _registry,
    _rules,
    _saving,
    _serving,
    _short_paths,
    _signals,
    _writes,
)
from assigntape._tf import (
    ConcreteFunction,
    Function,
    UnliftedInitializerVariable,
    array_ops,
    cond_v2,
    control_flow_util_v2,
    dataset_ops,
    distribute_lib,
    distribute_values,
    eager_tape,
    forwardprop,
    functional_ops,
    gen_array_ops,
    gen_dataset_ops,
    gen_experimental_dataset_ops,
    gen_resource_variable_ops,
    gen_state_ops,
    gen_training_ops,
    gradients_util,
    iterator_ops,
    map_fn_ops,
    mirrored_run,
    multi_device_iterator_ops,
    ops,
    parallel_for,
    pywrap_tfe,
    resource_variable_ops,
    saved_model_save,
    script_ops,
    standard_ops,
    state_ops,
    tpu_ops,
    while_v2,
)
from assigntape._wrapping import Place, Wrapper, patch

__all__ = [
    "acquire",
    "follow_plain_tapes",
    "installed",
    "refuse_unfollowed_recorders",
    "release",
    "remove_unused",
    "uninstall",
]

_installed = False
# The places of the attribute patches in place (or, for the read checks, ready).
_saved: List[Place] = []

_GEN_MODULES = (gen_resource_variable_ops, gen_state_ops, gen_array_ops, gen_training_ops)


def _snake(op_name: str, module: Any) -> str:
    """The op wrapper's Python name: ``AssignVariableOp`` -> ``assign_variable_op``."""
    key = op_name.lower()
    name: str
    for name in vars(module):
        if name.replace("_", "") == key and not name.endswith("_eager_fallback"):
            return name
    raise LookupError(op_name)


def _refused_with_wrappers() -> List[str]:
    """The refused writes (``_rules.refused``) that have a Python wrapper. Every
    generated wrapper is in tf.raw_ops, wherever its module is; the rest (XLA and
    TPU launches) exist only in graphs, where ``_functions`` refuses them."""
    names = set(vars(gen_training_ops)) | set(vars(tf.raw_ops))
    return sorted(name for name in names if _rules.refused(name) and name not in _rules.RULES)


def _module_of(op_name: str) -> Any:
    """The generated module that holds an op's wrappers."""
    for module in _GEN_MODULES:
        if op_name in vars(module):
            return module
    # Elsewhere (gen_tpu_ops, gen_stateful_random_ops): tf.raw_ops holds the
    # generated function itself, and its module has the snake-case wrapper too.
    return sys.modules[getattr(tf.raw_ops, op_name).__module__]


# TensorFlow modules that re-export generated op wrappers (``from gen_x import *``).
_ALIAS_MODULES = (resource_variable_ops, state_ops, array_ops, standard_ops, tpu_ops)


def _patch_targets() -> List[Tuple[List[Tuple[Any, str]], Any, Callable[..., Any]]]:
    """Each op: where its wrapper is found, the original, and our wrapper."""
    # tf.raw_ops and tf.compat.v2.raw_ops (a separate module holding the same
    # functions, which tf_keras calls). Not tf.compat.v1.raw_ops: it is a
    # TFModuleWrapper with its own attribute cache and a ~20 us __setattr__.
    raw_modules = [tf.raw_ops]
    for other in (tf.compat.v2.raw_ops, tf.compat.v1.raw_ops):
        # A TFModuleWrapper (tf.compat.v1.raw_ops) answers from its cache, or
        # else from the module it wraps: patch both.
        inner = getattr(other, "_tfmw_wrapped_module", None)
        for m in (other, inner):
            if m is not None and all(m is not known for known in raw_modules):
                raw_modules.append(m)
    written = list(_rules.RULES) + _refused_with_wrappers()
    targets = []
    for op_name in written:
        module = _module_of(op_name)
        snake = _snake(op_name, module)
        original = vars(module)[snake]
        params = list(original.__code__.co_varnames[: original.__code__.co_argcount])
        rule = _rules.RULES.get(op_name)
        if isinstance(rule, _fused.Kernel):
            wrapper = _writes.fused_write(op_name, rule, params)
        elif rule is not None:
            wrapper = _writes.tracked_write(op_name, rule, params)
        else:
            wrapper = _writes.untracked_write(op_name, params)
        # The snake-case wrapper and the raw op (`module.OpName`, which
        # tf.raw_ops also holds) are separate functions with the same code.
        places = [(module, snake)]
        places += [(m, op_name) for m in [module, *raw_modules] if op_name in vars(m)]
        # Modules that star-import the generated ones hold the same snake-case
        # function under their own name, and TensorFlow calls some writes
        # through them (tf.compat.v1 Adam's sparse step:
        # resource_variable_ops.resource_scatter_add): wrap those too.
        places += [(m, snake) for m in _ALIAS_MODULES if vars(m).get(snake) is original]
        targets.append((places, original, _dormant(wrapper)))
    for op_name in _RAW_READS:
        # Only the raw ops (``tf.raw_ops.ReadVariableOp``, ...), which take a
        # handle the caller may have kept: variables read through the
        # snake-case functions with ``v.handle``, already the current version,
        # and a wrapper there would cost every read.
        original = vars(gen_resource_variable_ops)[_snake(op_name, gen_resource_variable_ops)]
        params = list(original.__code__.co_varnames[: original.__code__.co_argcount])
        places = [(m, op_name) for m in [gen_resource_variable_ops, *raw_modules] if op_name in vars(m)]
        targets.append((places, vars(gen_resource_variable_ops)[op_name], _dormant(_writes.raw_read(params))))
    return targets


# The raw ops that read a variable through a resource handle, differentiably.
_RAW_READS = ("ReadVariableOp", "ResourceGather", "ResourceGatherNd")


# Built on first use and kept, grouped by the module that holds them, so that
# installing is one dict update per module.
class _Group:
    __slots__ = ("owner", "places", "get")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.places: List[Place] = []
        self.get: Any = None

    def add(self, name: str, wrapper: Callable[..., Any]) -> None:
        self.places.append(Place(self.owner, name, lambda below: Wrapper(below, wrapper)))
        self.get = operator.itemgetter(*(place.name for place in self.places))

    def put(self, on: bool) -> None:
        """Each place's wrapper (``on``) or what it wraps: at once where every
        place holds what ours expects, else place by place (``Place.put``:
        another library patched some of them since)."""
        current = self.get(vars(self.owner))
        current = current if len(self.places) > 1 else (current,)
        expected = [place.below if on else place.wrapper for place in self.places]
        if not all(map(operator.is_, current, expected)):
            for place in self.places:
                place.put(on)
            return
        functions = {place.name: place.wrapper if on else place.below for place in self.places}
        if hasattr(self.owner, "_fastdict_insert"):
            # tf.compat.v1.raw_ops is a TFModuleWrapper, whose attribute lookup
            # answers from a cache of its own before the instance dict: set
            # through it (slow, but the patches are installed once).
            for name, function in functions.items():
                setattr(self.owner, name, function)
        else:
            vars(self.owner).update(functions)


_groups: List[_Group] = []


def _build_wrappers() -> None:
    by_owner: Dict[int, _Group] = {}
    for places, _, wrapper in _patch_targets():
        for owner, name in places:
            by_owner.setdefault(id(owner), _Group(owner)).add(name, wrapper)
    _groups[:] = by_owner.values()


def _attribute_patches() -> List[Tuple[Any, str, Callable[..., Any]]]:
    """The patches besides the op wrappers: (owner, attribute, wrapper function)."""
    return [
        # Every variable's handle, noted as it is made, so that a write through
        # a handle fetched before a tape opened names its variable (_versions).
        # The two classes that make variables, not their base: every ``assign``
        # makes an ``_UnreadVariable`` through the base's ``__init__``.
        (resource_variable_ops.ResourceVariable, "__init__", _serving.constructed),
        (resource_variable_ops.UninitializedVariable, "__init__", _serving.constructed),
        # Calls of traced functions from an eager tape (_functions).
        (ConcreteFunction, "_call_flat", _functions.call_function),
        # tf.vectorized_map's function, named in refusals (_functions).
        (parallel_for, "pfor", _functions.vectorized),
        # Where tf.data's runtime runs a dataset's functions for the caller
        # (_datasets); TensorFlow calls the reduce op through the module.
        (iterator_ops.OwnedIterator, "__init__", _datasets.made_iterator),
        (iterator_ops.OwnedIterator, "_next_internal", _datasets.next_element),
        (iterator_ops.OwnedIterator, "get_next_as_optional", _datasets.next_element),
        (dataset_ops.DatasetV2, "reduce", _datasets.reduce_dataset),
        (dataset_ops.DatasetV2, "get_single_element", _datasets.single_element),
        (dataset_ops.DatasetV2, "save", _datasets.save_dataset),
        # tf.distribute's per-device iterators, fed by their source dataset (_datasets).
        (multi_device_iterator_ops.OwnedMultiDeviceIterator, "__init__", _datasets.multi_device_iterator),
        (gen_dataset_ops, "reduce_dataset", _datasets.reduce_op),
        (gen_experimental_dataset_ops, "save_dataset", _datasets.save_op),
        # TF1 iterators in a graph, noted with their datasets, whose functions
        # their get_next runs (_datasets).
        (dataset_ops.DatasetV1, "_make_initializable_iterator", _datasets.graph_iterator),
        (dataset_ops.DatasetV1, "_make_one_shot_iterator", _datasets.graph_iterator),
        (iterator_ops.Iterator, "make_initializer", _datasets.graph_iterator),
        (iterator_ops.Iterator, "get_next", _datasets.graph_next_element),
        (iterator_ops.Iterator, "get_next_as_optional", _datasets.graph_next_element),
        # A tf.function given datasets or iterators as arguments (_datasets).
        (Function, "_call", _datasets.function_call),
        # Variables a tf.function made on its first trace, given their first
        # values by TensorFlow (_functions).
        (Function, "_initialize_uninitialized_variables", _functions.initializing),
        (ConcreteFunction, "__call__", _datasets.function_call),
        # Reads of variables written through handles no tape could name (_versions).
        (eager_tape, "variable_accessed", _serving.accessed),
        # An op that failed in C++ (every generated op wrapper raises through
        # it): where an error the handle descriptor, which TensorFlow's C++
        # code calls, could not raise is raised (_serving.defer).
        (ops, "raise_from_not_ok_status", _serving.not_ok_status),
        # A variable made in a tf.function's first trace initializes itself
        # with a write in the graph, which is not the tape's (_versions).
        (UnliftedInitializerVariable, "__init__", _serving.constructing),
        # Values leaving TensorFlow, for explain() (_diagnostics).
        (ops._EagerTensorBase, "_numpy", _diagnostics.leave_tensorflow),
        # Cross-replica updates (_distribute). ``update`` is defined once, on the
        # base class, and every strategy's ``extended`` inherits it.
        (distribute_lib.StrategyExtendedV2, "update", _distribute.distributed_update),
        (distribute_lib.StrategyExtendedV2, "reduce_to", _distribute.cross_replica_reduce),
        (distribute_lib.StrategyExtendedV2, "batch_reduce_to", _distribute.cross_replica_reduce),
        (distribute_lib.StrategyExtendedV1, "update_non_slot", _distribute.non_slot_update),
        # An all-reduce in a replica's graph under a forward accumulator (_distribute).
        (distribute_lib.ReplicaContextBase, "all_reduce", _distribute.replica_all_reduce),
        # Replica threads that a merge_call's own call_for_each_replica starts
        # (Keras 3's LossScaleOptimizer) run as their replica (_distribute).
        (mirrored_run._MirroredReplicaThread, "run", _distribute.replica_thread_run),
        # MirroredVariable's replica-context write, which TensorFlow calls
        # through the module attribute.
        (distribute_values, "_on_write_update_replica", _distribute.aggregated_write),
        # Which variables a read watches, from the tape module's resolver (which
        # TensorFlow calls through the module attribute): as the replica's
        # own reads, when acting for it in merge_call (_distribute).
        (eager_tape, "_variables_override", _distribute.watched_as_replica),
        # Plain tapes beside ours name variables as ours do (_plain_tapes,
        # _plain_gradients).
        (_plain_tapes.GRADIENT_TAPE, "__enter__", _plain_tapes.entered),
        (_plain_tapes.GRADIENT_TAPE, "__exit__", _plain_tapes.exited),
        (_plain_tapes.GRADIENT_TAPE, "gradient", _plain_gradients.gradient),
        (_plain_tapes.GRADIENT_TAPE, "jacobian", _plain_gradients.jacobian),
        (_plain_tapes.GRADIENT_TAPE, "batch_jacobian", _plain_gradients.jacobian),
        (_plain_tapes.GRADIENT_TAPE, "reset", _plain_tapes.reset),
        (_plain_tapes.GRADIENT_TAPE, "watched_variables", _plain_gradients.watched_variables),
        (forwardprop.ForwardAccumulator, "__enter__", _plain_tapes.accumulator_enter),
        (forwardprop.ForwardAccumulator, "__exit__", _plain_tapes.accumulator_exit),
        (forwardprop.ForwardAccumulator, "jvp", _plain_gradients.accumulator_jvp),
        # tf.cond and graph loops, which TensorFlow calls through the module
        # attributes (_control_flow).
        (cond_v2, "cond_v2", _control_flow.cond),
        (cond_v2, "_build_cond", _control_flow.build_cond),
        (cond_v2, "indexed_case", _control_flow.indexed_case),
        (while_v2, "while_loop", _control_flow.while_loop),
        # Builders that set the variable scope's caching device and put it back
        # only on success (_control_flow).
        *[(owner, name, _control_flow.variable_scope_kept) for owner, name in _variable_scope_builders()],
        # A cond's or loop's gradient after tf.gradients went through it.
        (cond_v2, "_grad_fn", _control_gradients.branch_gradient),
        (while_v2, "_create_grad_func", _control_gradients.loop_gradient),
        # The branch or body graphs of a cond, case or loop whose gradient is
        # built (by forward mode) as the op is made, before TensorFlow keeps
        # them on the op; TensorFlow calls it through the module attribute.
        (control_flow_util_v2, "get_func_graph", _control_gradients.made_from),
        # Which gradient functions a cond, case, loop or function call in a
        # graph prepares; TensorFlow calls it through the module attribute.
        (gradients_util, "PossibleTapeGradientTypes", _control_gradients.possible_gradient_types),
        # tf.gradients after the tape that wrote a variable exited (_graph_gradients).
        (gradients_util, "_GradientsHelper", _graph_gradients.gradients),
        # py_function bodies, which a tape's graph runs later (_py_functions).
        (script_ops, "_internal_py_func", _py_functions.py_function),
        # Saving a module whose functions hold a tape's writes (_saving).
        (saved_model_save, "_trace_gradient_functions", _saving.trace_gradient_functions),
        # Signal handlers set later are guarded too (_signals).
        (signal, "signal", _signals.setsignal),
        (signal, "getsignal", _signals.getsignal),
    ]


def _variable_scope_builders() -> List[Tuple[Any, str]]:
    """Where ``tf.map_fn``, ``scan``, ``foldl`` and ``foldr`` are found: their
    modules, where the v2 API's functions call them, and ``tf.compat.v1``'s
    API modules (and ``standard_ops``), which hold the functions themselves."""
    names = ("map_fn", "scan", "foldl", "foldr")
    found: List[Tuple[Any, str]] = [(map_fn_ops, "map_fn")] + [(functional_ops, n) for n in names[1:]]
    nested = [getattr(getattr(tf.compat, v, None), "compat", None) for v in ("v1", "v2")]
    apis = [tf.compat.v1, *[getattr(c, "v1", None) for c in nested], standard_ops]
    for api in {id(module): module for module in apis if module is not None}.values():
        found += [(api, n) for n in names if hasattr(api, n)]
    return found


def _dormant(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, but the original straight away while no tape is open in
    any thread and none is closed but alive: the patches stay installed between
    tapes, and code outside every tape must run as plain TensorFlow."""
    scopes, closed = _registry._all_scopes, _leases.closed_refs

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        if not scopes and not closed:
            if _registry._switched:
                _registry.idle()  # may take this and the other switches off
            return wrapped(*args, **kwargs)
        return function(wrapped, instance, args, kwargs)

    return wrapper


# Never dormant, and installed at import but for the last: plain tapes are
# followed from their entry whether or not a tape of ours is open then, since
# one may open inside them (_plain_tapes); every variable's handle is noted as
# it is made; and a non-persistent tape asked for its gradient is closed and
# done, yet its gradient may go through a cond's or loop's, which must know
# whether a tape recorded an earlier one (_control_gradients.branch_gradient); and
# a module is saved after every tape is gone (_saving); and a function may be
# traced before the first tape around a dataset that writes (_datasets), and
# a py_function traced then may write when a tape is open (_py_functions).
_ALWAYS_ON = (
    _saving.trace_gradient_functions,
    _datasets.function_call,
    _datasets.next_element,
    _datasets.reduce_dataset,
    _datasets.reduce_op,
    _datasets.save_dataset,
    _datasets.save_op,
    _datasets.made_iterator,
    _graph_gradients.gradients,
    _py_functions.py_function,
    _datasets.multi_device_iterator,
    _datasets.single_element,
    _datasets.graph_iterator,
    _datasets.graph_next_element,
    _control_gradients.branch_gradient,
    _control_gradients.loop_gradient,
    _serving.constructed,
    _plain_tapes.entered,
    _plain_tapes.exited,
    _plain_gradients.jacobian,
    _plain_tapes.reset,
    _plain_gradients.watched_variables,
    _plain_tapes.accumulator_enter,
    _plain_tapes.accumulator_exit,
    _plain_gradients.accumulator_jvp,
)

# Not dormant, and in place from import: a function in whose graph a tape
# was open holds that tape's variables while it runs, when no tape is open
# anywhere too (``_compiled_tapes``); its dormant hook runs inside.
_LEASED = (_functions.call_function,)

# Followers that let the original run from the patched method's own frame
# for an instance that needs no following (``_wrapping.patch``): one Python
# frame fewer under a plain tape's backward pass.
_PASSES = {
    _plain_gradients.gradient: _plain_gradients.unfollowed,
    _plain_gradients.watched_variables: _plain_gradients.ours,
}

# Followers whose methods are built by their module, with the common case
# written out (every Keras train step enters and exits a plain tape).
_METHODS = {
    _plain_tapes.entered: _plain_tapes.enter_method,
    _plain_tapes.exited: _plain_tapes.exit_method,
    _plain_tapes.accumulator_enter: _plain_tapes.accumulator_enter_method,
    _plain_tapes.accumulator_exit: _plain_tapes.accumulator_exit_method,
}

# Not dormant, yet switched: a plain tape's gradient has something to map
# only beside a tape of ours, or while one that ran beside it keeps versions
# (which keeps the switches on: ``_registry.idle``). Every Keras train step
# asks one, so TensorFlow's own is in place otherwise.
_SWITCHED = (_plain_gradients.gradient,)

# Not dormant, and in place from the first tape to ``uninstall()``: a signal
# handler set between tapes must be guarded for the next (``_signals``).
_INSTALLED_ON = (_signals.setsignal, _signals.getsignal)

# In place only while a tape has seen a write through a handle no tape could
# name: every variable read calls them (``_registry.read_checks``).
_READ_CHECKS = (_serving.accessed,)

# In place only while some thread acts for a replica (``_registry.acting_checks``):
# every variable read calls them too.
_ACTING_CHECKS = (_distribute.watched_as_replica,)

# (id(owner), attribute) -> the place of the patch there.
_places: Dict[Tuple[int, str], Place] = {}


def _maker(owner: Any, function: Callable[..., Any]) -> Callable[[Any], Any]:
    """What builds the patch that calls ``function`` around what is found on ``owner``."""
    if function in _METHODS:
        return _METHODS[function]
    plain = (
        function in _ALWAYS_ON
        or function in _INSTALLED_ON
        or function in _SWITCHED
        or function in _READ_CHECKS
        or function in _ACTING_CHECKS
    )
    active = function if plain else _dormant(function)
    if function in _LEASED:
        active = _compiled_tapes.leased(active, _functions.function_writes, _datasets.given_writes)
    return lambda below: patch(owner, below, active, _PASSES.get(function))


def _put(owner: Any, name: str, function: Callable[..., Any]) -> None:
    """Wraps ``owner.name`` with ``function`` (unless it is wrapped already)."""
    place = _places.get((id(owner), name))
    if place is None:
        place = _places[(id(owner), name)] = Place(owner, name, _maker(owner, function))
    elif place in _saved:
        return  # a follower, in place since import
    _saved.append(place)
    if function in _READ_CHECKS:
        # Put in place (and taken off) by ``_versions``, when there is something to check.
        _registry.read_checks.append(place)
        return
    if function in _ACTING_CHECKS:
        # Put in place (and taken off) by ``_threads.acting_for``.
        _registry.acting_checks.append(place)
        return
    place.put(True)
    if function not in _ALWAYS_ON and function not in _INSTALLED_ON and function not in _LEASED:
        _registry.switches.append(place.put)


def _install() -> None:
    if not _groups:
        _build_wrappers()  # first use
    for owner, name, function in _attribute_patches():
        _put(owner, name, function)
    _serve_short_paths()
    # Before the handle descriptor goes on: no signal handler may raise in it.
    _signals.guard_all()
    _registry.serve_handles(True)
    _jvp.register(True)
    for group in _groups:
        group.put(True)
        if not hasattr(group.owner, "_fastdict_insert"):
            # (tf.compat.v1.raw_ops, slow to set, keeps its dormant wrappers.)
            _registry.switches.append(group.put)
    global _installed
    _installed = True


def _serve_short_paths() -> None:
    """The eager short paths of ``ResourceVariable.value``, ``assign``,
    ``assign_add`` and ``assign_sub`` (``_short_paths``), served like the
    handle descriptor: on the class only while a tape is open."""
    cls = resource_variable_ops.ResourceVariable
    for name in _short_paths.METHODS:
        if any(o is cls and n == name for o, n, _, _ in _registry.served):
            continue  # served already (installed before, then uninstalled)
        original = vars(cls).get(name)  # TensorFlow's own there, or None: the base class's
        method = getattr(cls, name)
        if not _short_paths.is_tensorflows(method):
            # Someone wrapped it (before the first tape): theirs must run.
            continue
        short = _short_paths.value_method(method) if name == "value" else _short_paths.write_method(name, method)
        _registry.served.append((cls, name, short, original))
    conversion = vars(ops)["convert_to_tensor"]
    if _short_paths.is_tensorflows_conversion(conversion) and not any(o is ops for o, _, _, _ in _registry.served):
        _registry.served.append((ops, "convert_to_tensor", _short_paths.convert_function(conversion), conversion))


def follow_plain_tapes() -> None:
    """Installs, at import, the patches that follow plain tapes and forward
    accumulators (``_ALWAYS_ON``): a ``tf.GradientTape`` entered before the
    process's first ``AssignAwareTape`` and open around it must be followed
    like any other (it would otherwise give plain TensorFlow's answer, a
    silently wrong gradient, on the first step only). They cost a plain tape
    a few microseconds and nothing else."""
    with _leases.lock:
        if not _installed:
            for owner, name, function in _attribute_patches():
                if function in _ALWAYS_ON:
                    _put(owner, name, function)


def refuse_unfollowed_recorders() -> None:
    """Before an ``AssignAwareTape`` is entered with the patches not installed
    (after ``uninstall()``, or with assigntape imported inside a tape): a
    gradient tape recording in this thread that no patch saw entered cannot
    be followed. Refused, rather than its gradient silently wrong."""
    if _installed or pywrap_tfe.TFE_Py_TapeSetIsEmpty():
        return
    if any(ref() is not None for ref, _ in _registry.open_plain()):
        return  # some are followed: the others, if any, cannot be told apart
    follow_plain_tapes()  # tapes entered from now on are followed
    raise RuntimeError(
        "A tf.GradientTape is recording in this thread that was entered while "
        "assigntape's patches were not installed (after assigntape.uninstall(), or "
        "before assigntape was imported): it cannot follow this AssignAwareTape's "
        "writes, so its gradient would be silently wrong. Enter that tape after "
        "importing assigntape and without calling uninstall() in between."
    )


def _uninstall() -> None:
    _registry.serve_handles(False)
    _signals.unguard_all()
    _jvp.register(False)
    # Only what is still ours: a patch made around ours since stays, ours
    # (dormant: TensorFlow's own runs at once) inside it, found there again
    # by the next install (``Place``).
    for group in _groups:
        group.put(False)
    while _saved:
        _saved.pop().put(False)


def acquire(holder: Any = None) -> None:
    """``holder`` (an open tape's record) needs the patches: the first
    installs them. With no holder, only installs them."""
    # (One line: see _registry._list.)
    with _leases.lock: _acquire_locked(holder)  # noqa: E701  # fmt: skip


def _acquire_locked(holder: Any) -> None:
    if not _installed:
        try:
            _install()  # sets _installed, as its last step
        except BaseException:
            # Interrupted (a KeyboardInterrupt): all or nothing, or the
            # next install would wrap the wrappers put in place so far.
            _uninstall()
            raise
    if holder is not None:
        _leases.take(holder)


def release(holder: Any) -> None:
    """``holder`` no longer does. The patches stay (dormant) until ``uninstall``."""
    _leases.give(holder)


def uninstall() -> None:
    """Removes every patch assigntape installed, putting back TensorFlow's own objects.

    The first ``AssignAwareTape`` entered installs the patches; they stay,
    dormant (each patched function calls TensorFlow's own at once while no
    tape is open), so that later tapes cost nothing to open. Call this to
    leave TensorFlow exactly as it was, for example before handing the
    process to code that inspects TensorFlow's functions. The next tape
    entered installs them again.

    Raises:
        RuntimeError: a tape still needs them: an open ``AssignAwareTape``, a
            closed one that may be entered again or asked for gradients, a
            ``tf.GradientTape`` or ``ForwardAccumulator`` open now (in any
            thread), or one that ran beside an ``AssignAwareTape``. Nothing is
            removed then.
    """
    import gc

    # Closed tapes waiting in reference cycles hold leases: let them go first.
    gc.collect()
    users = remove_unused()
    if users:
        raise RuntimeError(
            f"assigntape.uninstall(): {users} tape(s) still need the patches: an open "
            "AssignAwareTape, a closed one that may be entered again or asked for "
            "gradients, a tf.GradientTape or ForwardAccumulator open now, or one that "
            "ran beside an AssignAwareTape. Let them go (del, or leave their scope), "
            "then call uninstall() again."
        )


def remove_unused() -> int:
    """``uninstall()`` without its garbage collection: removes every patch
    unless a tape needs them, and returns how many do (0: removed)."""
    global _installed
    with _leases.lock:
        # A plain tape or accumulator open now was entered through the
        # followers: removed under it, its exit would not be noted, and the
        # next tape of ours to close would take it for one still open (and
        # keep its versions for good).
        users = _leases.count() + _plain_tapes.open_anywhere()
        if not users and (_installed or _saved):  # everything, or the followers of plain tapes
            _uninstall()
            _installed = False
        return users


def installed() -> bool:
    return _installed


def patched_places() -> List[Tuple[Any, str]]:
    """Every attribute the patches replace (for tests and diagnostics)."""
    if not _groups:
        _build_wrappers()
    base = resource_variable_ops.BaseResourceVariable
    return (
        [(base, "_handle")]
        + [(resource_variable_ops.ResourceVariable, name) for name in _short_paths.METHODS]
        + [(ops, "convert_to_tensor")]
        + [(owner, name) for owner, name, _ in _attribute_patches()]
        + [(group.owner, place.name) for group in _groups for place in group.places]
    )
