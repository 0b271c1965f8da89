"""TensorFlow's internals, behind one fence.

Every ``tensorflow.python`` module the library uses is imported here, and
every private TensorFlow attribute it touches is listed here with what it is
for. When a TensorFlow release moves one of them, ``import assigntape`` fails
at once with one ``ImportError`` naming what is missing and the supported
versions, instead of failing deep inside a user's training step.

The other modules import TensorFlow's internals from here only
(``from assigntape._tf import ops, record``); ``tests/test_tf_fence.py``
checks that.
"""

from __future__ import annotations

import types
from typing import Any, List, Tuple

import tensorflow as tf

# The TensorFlow versions this release is tested on (setup.cfg, tox, CI).
SUPPORTED = "2.16 to 2.21"

try:
    # Node attributes: keeping Grappler from bypassing a version's IdentityN.
    # A dataset's serialized graph: the functions of one known only by its variant.
    from tensorflow.core.framework import attr_value_pb2, graph_pb2

    # The eager C API: the tape set (is recording stopped?) and jvp packing.
    from tensorflow.python import pywrap_tfe

    # AutoGraph's allow-list, so that our wrappers are not converted.
    from tensorflow.python.autograph.core import config, config_lib

    # AutoGraph's conversion of a tf.function's Python body, as a trace does it
    # (a writing function called in a tape's graph is traced inline: _functions).
    from tensorflow.python.autograph.core import converter as autograph_converter
    from tensorflow.python.autograph.impl import api as autograph_api

    # tf.data: where a dataset's functions run (iterators, reduce, single elements).
    from tensorflow.python.data.ops import dataset_ops, iterator_ops, multi_device_iterator_ops

    # Strategies' update(), and the container a distributed component belongs to.
    # MirroredStrategy's replica threads (a merge_call's own call_for_each_replica).
    from tensorflow.python.distribute import distribute_lib, distribute_utils, mirrored_run
    from tensorflow.python.distribute import values as distribute_values

    # Parameter servers' partitioned variables, which no tape takes as a whole.
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    # GradientTape, ForwardAccumulator, eager context, recording ops on tapes,
    # and the hook every variable read calls.
    from tensorflow.python.eager import backprop, context, forwardprop, record
    from tensorflow.python.eager import tape as eager_tape

    # What a tf.function call runs (captures are mapped to versions there).
    from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction

    # The variables a tf.function makes on its first trace (their initialization).
    # A tf.function's call with its Python arguments (datasets and iterators among them).
    from tensorflow.python.eager.polymorphic_function.polymorphic_function import (
        Function,
        UnliftedInitializerVariable,
    )

    # Graph building: ops, dtypes, tensors, automatic control dependencies.
    from tensorflow.python.framework import (
        auto_control_deps,
        composite_tensor,
        dtypes,
        indexed_slices,
        op_callbacks,
        op_def_registry,
        ops,
        tensor_conversion_registry,
        tensor_util,
    )
    from tensorflow.python.framework import tensor as tensor_lib

    # Ops, the generated op wrappers that write variables, and control flow v2.
    # tf.py_function / tf.numpy_function: the Python body a graph runs later.
    from tensorflow.python.ops import (
        array_ops,
        check_ops,
        cond_v2,
        control_flow_util,
        control_flow_util_v2,
        default_gradient,
        functional_ops,
        gen_array_ops,
        gen_dataset_ops,
        gen_experimental_dataset_ops,
        gen_resource_variable_ops,
        gen_state_ops,
        gen_training_ops,
        gradients_util,
        handle_data_util,
        math_ops,
        resource_variable_ops,
        script_ops,
        standard_ops,
        state_ops,
        tensor_array_ops,
        variable_scope,
        while_v2,
    )

    # tf.map_fn's module (its function has the module's name).
    from tensorflow.python.ops import map_fn as map_fn_ops

    # The graph class of a tf.cond branch or while body.
    from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

    # tf.vectorized_map's (and jacobian's) vectorizer, which traces a tf.function.
    from tensorflow.python.ops.parallel_for import control_flow_ops as parallel_for
    from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

    # Whether TensorFlow's profiler traces (``ops.convert_to_tensor`` then notes itself).
    from tensorflow.python.profiler import trace as profiler_trace

    # SavedModels: where the gradients of a module's functions are saved.
    from tensorflow.python.saved_model import save as saved_model_save

    # A module that star-imports generated write ops (gen_tpu_ops).
    from tensorflow.python.tpu.ops import tpu_ops

    # tf.compat.v1 optimizers, whose slots are keyed by variable.
    from tensorflow.python.training import optimizer as v1_optimizer
    from tensorflow.python.util import nest, variable_utils
except ImportError as error:  # pragma: no cover - only on an unsupported TensorFlow
    raise ImportError(
        f"assigntape supports TensorFlow {SUPPORTED}; TensorFlow {tf.__version__} has no "
        f"{getattr(error, 'name', None) or error}. Install a supported version "
        "(pip install 'tensorflow>=2.16,<2.22')."
    ) from error

BaseResourceVariable = resource_variable_ops.BaseResourceVariable

# Private (or unexported) attributes on classes and modules, each with its
# use; checked at import. Instance attributes used but not checkable without
# running TensorFlow: a variable's ``_handle`` (the descriptor's storage) and
# ``_unique_id`` (the key of its versions); a tape's ``_tape`` and
# ``_recording``; an EagerTensor's ``_handle_data``; the wrapped variable of
# Keras 3's ``Variable`` (``_value``), the eager context's ``_thread_local_data``
# (``executing_eagerly``), tf_keras' ``AutoCastVariable``
# (``_variable``) and ``AggregatingVariable`` (``_v``); a TFModuleWrapper's
# ``_tfmw_wrapped_module`` and ``_fastdict_insert`` (tf.compat.v1.raw_ops);
# a ``tf.function``'s ``_autograph`` and ``_experimental_autograph_options``
# (how its trace converts its body: ``_functions.inline``);
# MirroredStrategy's replica threads' ``replica_id``, ``distribution``, ``done``
# and ``should_run`` (mirrored_run._MirroredReplicaThread: which replica of which
# strategy, paused in merge_call, a cross-replica update is for; and, for one a
# merge_call starts, ``main_fn``, ``in_eager`` and ``graph``), and a
# ReplicaContext's ``_thread_context`` (the mode a merge_call's own replica
# threads run in: their replica's).
PRIVATE: List[Tuple[Any, str, str]] = [
    (BaseResourceVariable, "handle", "every read path gets the variable's handle here"),
    (ops.EagerTensor, "_copy_nograd", "a new version of an eager handle without an op"),
    (ops._EagerTensorBase, "_numpy", "explain() notes values leaving TensorFlow"),
    (ConcreteFunction, "_call_flat", "a tf.function call from an eager tape"),
    (cond_v2, "_build_cond", "writes in tf.cond branches"),
    (cond_v2, "cond_v2", "writes in tf.cond branches"),
    (while_v2, "while_loop", "writes in graph loops"),
    (cond_v2, "indexed_case", "tf.switch_case ops a tape recorded"),
    (gradients_util, "PossibleTapeGradientTypes", "conds, loops and calls in a graph prepared for higher order"),
    (gradients_util, "_GradientsHelper", "the graph gradient of a fused kernel's version in a tape's graph"),
    (cond_v2, "_grad_fn", "a cond's gradient after tf.gradients added outputs to it"),
    (while_v2, "_create_grad_func", "a loop's gradient built while a tape records"),
    (control_flow_util_v2, "get_func_graph", "a cond's, case's or loop's gradient built as the op is made"),
    (ops.Graph, "_get_function", "the graph a cond's, case's or loop's function was made from"),
    (backprop.GradientTape, "_push_tape", "pausing one tape while recording on others"),
    (backprop.GradientTape, "_pop_tape", "pausing one tape while recording on others"),
    (backprop.GradientTape, "_ensure_recording", "reading a version on a plain tape"),
    (eager_tape, "variable_accessed", "refusing reads of variables written unseen"),
    (eager_tape, "_variables_override", "a replica's update in merge_call watches what the replica's reads watch"),
    (ops, "raise_from_not_ok_status", "a read failed in C++ raises the error the handle descriptor deferred"),
    (distribute_lib.StrategyExtendedV2, "update", "cross-replica updates"),
    (distribute_lib.StrategyExtendedV1, "update_non_slot", "tf.compat.v1 optimizers' non-slot updates"),
    (distribute_lib.StrategyExtendedV2, "reduce_to", "reductions in merge_call, linked on the replicas' tapes"),
    (distribute_lib.StrategyExtendedV2, "batch_reduce_to", "reductions in merge_call, linked on the replicas' tapes"),
    (distribute_lib, "get_update_replica_id", "the replica a component's update is for"),
    (distribute_lib.StrategyExtendedV2, "_container_strategy", "whose replicas a cross-replica update is for"),
    (mirrored_run, "_MirroredReplicaThread", "replica threads a merge_call starts run as their replica"),
    (distribute_lib, "_push_per_thread_mode", "a merge_call's replica threads in their replica's context"),
    (distribute_lib, "_pop_per_thread_mode", "a merge_call's replica threads in their replica's context"),
    (eager_tape, "push_tape", "recording a replica's update on its tapes, in merge_call"),
    (eager_tape, "pop_tape", "recording a replica's update on its tapes, in merge_call"),
    (pywrap_tfe, "TFE_Py_TapeSetShouldRecordBackprop", "whether a replica's tapes watch a value"),
    (distribute_utils, "value_container", "the distributed variable of a component"),
    (auto_control_deps, "register_acd_resource_resolver", "ordering ops on versions in bodies"),
    (handle_data_util, "copy_handle_data", "versions keep the variable's shape and dtype"),
    (resource_variable_ops, "get_eager_safe_handle_data", "the dtype behind a bare handle"),
    (pywrap_tfe, "TFE_Py_TapeSetIsStopped", "whether a write is recorded"),
    (context, "_context", "executing_eagerly() without two Python calls, on every variable read"),
    (pywrap_tfe, "TFE_Py_PackJVPs", "whether a write's inputs carry tangents"),
    (pywrap_tfe, "TFE_Py_ForwardAccumulatorSetAdd", "a replica's accumulators record its update, in merge_call"),
    (pywrap_tfe, "TFE_Py_ForwardAccumulatorSetRemove", "a replica's accumulators record its update, in merge_call"),
    (record, "record_operation_backprop_only", "a write's version on reverse tapes"),
    (record, "record_operation_forwardprop_only", "a write's version on accumulators"),
    (forwardprop, "_jvp_dispatch", "TensorFlow's jvp function, which ours calls for all but Sqrt at 0 (_jvp)"),
    (pywrap_tfe, "TFE_Py_RegisterJVPFunction", "registering ours while the patches are installed (_jvp)"),
    (control_flow_util, "GraphOrParentsInXlaContext", "refusing what XLA cannot check"),
    (variable_utils, "convert_variables_to_tensors", "cond and loop outputs that are variables"),
    (config_lib, "DoNotConvert", "AutoGraph leaves our wrappers alone"),
    (ops.Operation, "_set_attr", "marking a body's version handle _grappler_do_not_remove"),
    (distribute_values, "_on_write_update_replica", "aggregated writes in replica context"),
    (resource_variable_ops, "_UnreadVariable", "what the eager write short paths return"),
    (BaseResourceVariable, "_lazy_read", "the write methods' result, which the short paths build as it does"),
    (BaseResourceVariable, "_read_variable_op", "the read that the value() short path does as it does"),
    (ops, "is_auto_dtype_conversion_enabled", "dtype promotion mode, left to TensorFlow's write methods"),
    (ops, "_default_graph_stack", "eager with no graph pushed: where the short paths apply"),
    (
        tensor_conversion_registry,
        "_tensor_conversion_func_cache",
        "whether variables still convert as TensorFlow registered",
    ),
    (resource_variable_ops, "_dense_var_to_tensor", "the conversion TensorFlow registered for variables"),
    (BaseResourceVariable, "_dense_var_to_tensor", "what that conversion calls, ending in value()"),
    (dataset_ops.DatasetV2, "_inputs", "the datasets whose functions an iterator runs"),
    (dataset_ops.DatasetV2, "_functions", "the functions a dataset runs, which may write variables"),
    (dataset_ops, "_VariantDataset", "a dataset argument inside a tf.function's graph"),
    (multi_device_iterator_ops.OwnedMultiDeviceIterator, "__init__", "tf.distribute's per-device iterators"),
    (Function, "_call", "a tf.function call, with the datasets among its arguments"),
    (Function, "python_function", "a writing tf.function's body, traced inline in a tape's graph"),
    (Function, "_initialize_uninitialized_variables", "variables a first trace made, given their values"),
    (autograph_api, "converted_call", "AutoGraph's conversion of that body, as the trace calls it"),
    (autograph_converter, "ConversionOptions", "the options of that conversion"),
    (ConcreteFunction, "__call__", "a concrete function's call, with the datasets among its arguments"),
    (iterator_ops.OwnedIterator, "_next_internal", "a dataset's functions run at each element"),
    (dataset_ops.DatasetV1, "_make_initializable_iterator", "a TF1 iterator, noted with its dataset"),
    (dataset_ops.DatasetV1, "_make_one_shot_iterator", "a TF1 iterator, noted with its dataset"),
    (script_ops, "_internal_py_func", "py_function bodies run when a tape's graph runs"),
    (saved_model_save, "_trace_gradient_functions", "refusing to save the gradients of a tape's writes"),
]


def _inner_code(function: Any, name: str) -> Any:
    """The code object of the function ``name`` defined inside ``function``."""
    for const in function.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == name:
            return const
    return None


# ReplicaContext.all_reduce's merge_call function, which reduces in
# cross-replica context under a custom gradient of TensorFlow's own: the
# replicas' tapes already follow it (``_distribute.cross_replica_reduce``).
ALL_REDUCE_MERGE_FN = _inner_code(distribute_lib.ReplicaContext.all_reduce, "batch_all_reduce")

# ReplicaContext.merge_call, where a replica thread waits while its merge_call
# function runs: the frame that holds the replica's own ReplicaContext
# (``_distribute.replica_thread_run``).
REPLICA_MERGE_CALL = distribute_lib.ReplicaContext.merge_call.__code__

# tf.compat.v1.train optimizers' update function and the function that
# updates their non-slot variables (``_finish``), in their _distributed_apply.
V1_OPTIMIZER_UPDATE = _inner_code(v1_optimizer.Optimizer._distributed_apply, "update")
V1_OPTIMIZER_FINISH = _inner_code(v1_optimizer.Optimizer._distributed_apply, "finish")


def _check() -> None:
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in PRIVATE if not hasattr(owner, name)]
    if ALL_REDUCE_MERGE_FN is None:
        missing.append("ReplicaContext.all_reduce.<locals>.batch_all_reduce")
    if V1_OPTIMIZER_UPDATE is None or V1_OPTIMIZER_FINISH is None:
        missing.append("Optimizer._distributed_apply.<locals>.update / finish")
    if missing:
        raise ImportError(
            f"assigntape supports TensorFlow {SUPPORTED}; TensorFlow {tf.__version__} lacks "
            f"{', '.join(missing)}. Install a supported version (pip install 'tensorflow>=2.16,<2.22')."
        )


_check()


def executing_eagerly() -> bool:
    """``tf.executing_eagerly()``, at a fraction of its cost.

    The ``_handle`` descriptor asks it on every variable read (three times a
    read: TensorFlow fetches ``v.handle`` that often), where the public
    function's two Python calls were a third of the tape's per-read cost. The
    context's thread-local data (a C++ object, the public function's own
    source) answers directly; before the context exists, the public function.
    """
    ctx = context._context
    if ctx is None:
        eager: bool = context.executing_eagerly()
    else:
        eager = ctx._thread_local_data.is_eager
    return eager


__all__ = [
    "SUPPORTED",
    "PRIVATE",
    "ALL_REDUCE_MERGE_FN",
    "REPLICA_MERGE_CALL",
    "V1_OPTIMIZER_FINISH",
    "V1_OPTIMIZER_UPDATE",
    "BaseResourceVariable",
    "ConcreteFunction",
    "Function",
    "ControlFlowFuncGraph",
    "ShardedVariable",
    "UnliftedInitializerVariable",
    "UnconnectedGradients",
    "array_ops",
    "attr_value_pb2",
    "autograph_api",
    "autograph_converter",
    "auto_control_deps",
    "backprop",
    "check_ops",
    "composite_tensor",
    "cond_v2",
    "config",
    "config_lib",
    "context",
    "control_flow_util",
    "control_flow_util_v2",
    "dataset_ops",
    "gen_dataset_ops",
    "gen_experimental_dataset_ops",
    "graph_pb2",
    "iterator_ops",
    "multi_device_iterator_ops",
    "default_gradient",
    "distribute_lib",
    "distribute_utils",
    "distribute_values",
    "mirrored_run",
    "dtypes",
    "eager_tape",
    "executing_eagerly",
    "forwardprop",
    "functional_ops",
    "gen_array_ops",
    "gen_resource_variable_ops",
    "gen_state_ops",
    "gen_training_ops",
    "gradients_util",
    "handle_data_util",
    "indexed_slices",
    "map_fn_ops",
    "math_ops",
    "nest",
    "op_callbacks",
    "op_def_registry",
    "ops",
    "profiler_trace",
    "pywrap_tfe",
    "record",
    "resource_variable_ops",
    "parallel_for",
    "saved_model_save",
    "script_ops",
    "standard_ops",
    "state_ops",
    "tensor_array_ops",
    "tensor_conversion_registry",
    "tensor_lib",
    "tensor_util",
    "variable_scope",
    "tpu_ops",
    "v1_optimizer",
    "variable_utils",
    "while_v2",
]
