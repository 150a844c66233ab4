"""torch's and torchao's private names: DTensor's shard, the compiler's counters and cache, DCP's stager,
FSDP2's reshard setting, torchao's float8 weight wrappers."""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Iterator

from raytune_ft.compat.core import TORCH, TORCHAO, CompatError, Internal, PrivateAttr, installed, private_attr

TORCH_DTENSOR_OFFSETS = Internal(
    "torch", "torch.distributed.tensor._utils", ("compute_local_shape_and_global_offset",), TORCH,
    why="to read each rank's shard of a weight straight from the files (models/build.py): DTensor has no "
        "public way to ask where its local shard starts")
TORCH_DYNAMO_COUNTERS = Internal(
    "torch", "torch._dynamo.utils", ("calculate_time_spent", "counters"), TORCH,
    why="for the start-up breakdown's compile seconds and cache hits (train/common.py): torch.compile "
        "reports neither publicly")

TORCH_INDUCTOR_CACHE_DIR = Internal(
    "torch", "torch._inductor.runtime.cache_dir_utils", ("default_cache_dir",), TORCH,
    why="to tell Inductor's own default cache folder, inherited through TORCHINDUCTOR_CACHE_DIR, from a "
        "user's choice (train/jit_cache.py)")

TORCH_DTENSOR_LOCAL = PrivateAttr(
    "torch", "torch.distributed.tensor", "DTensor", "_local_tensor", TORCH,
    why="for the tensor a DTensor holds, itself (train/fp8.py): a state dict that loads in place must share it, "
        "and the public to_local() hands a parameter's out as a new view")
TORCH_NON_PERSISTENT_BUFFERS = PrivateAttr(
    "torch", "torch.nn", "Module", "_non_persistent_buffers_set", TORCH, named_in="__init__",
    why="for the buffers a checkpoint does not hold (models/build.py fills the others from the files): "
        "nn.Module lists them publicly only through state_dict(), which a sharded model would run its hooks for")


def dtensor_local(t):
    """The local tensor DTensor `t` holds (the same tensor object); another tensor as it is."""
    from torch.distributed.tensor import DTensor

    return TORCH_DTENSOR_LOCAL.read(t) if isinstance(t, DTensor) else t


def _torch_minor() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _stager_closes_copier() -> bool:
    # pytorch#183413: 2.11's DefaultStager._stage closes its state-dict copier at the end of every stage, so a
    # stager is not reusable (the fix, pytorch#183424, is in 2.13); before 2.11 it never did
    return (2, 11) <= _torch_minor() < (2, 13)


def keep_stager_buffers(stager) -> Callable[[], None]:
    """For DCP's `DefaultStager` kept across a run's saves: on a torch that closes the stager's copier after
    every stage, the pinned host buffers would be dropped and pinned again inside every save (while the
    loop waits), and the next save fails with KeyError: <class 'type'>. There the copier's close is held
    back; the returned function closes it (call it after `stager.close()`). Elsewhere: nothing to do."""
    if not _stager_closes_copier():
        return lambda: None
    copier = getattr(stager, "_state_dict_stager", None)
    if copier is None or not callable(getattr(copier, "close", None)):
        raise CompatError(f"{installed('torch')}: DefaultStager has no _state_dict_stager with a close(); "
                          "raytune_ft holds that close back so the stager can be reused across saves "
                          f"(pytorch#183413); checked on {TORCH}. Update raytune_ft/compat/ for this torch.")
    close = copier.close
    copier.close = lambda: None
    return close


@contextlib.contextmanager
def fsdp_kept_unsharded(modules: list) -> Iterator[None]:
    """Inside it, the FSDP2 `modules` keep their parameters unsharded after a forward (FSDP2's public
    `set_reshard_after_forward(False)`); on leaving, each gets back its own setting and is resharded. FSDP2
    has no public getter for a module's setting, and its setter also drops the root's automatic choice: the
    state's `_auto_reshard_after_forward` and each parameter group's `post_forward_mesh_info` are kept and put
    back (torch 2.11 holds one group per state in `_fsdp_param_group`, 2.13 a list in `_fsdp_param_groups`).
    A probe can be the model's first forward (the samples before the first step), where FSDP2's lazy set-up
    makes the root keep its parameters after a forward, where it was left to choose (`_is_root`); the
    setting put back then is that choice, not the one saved before it was made."""
    saved = []
    for m in modules:
        state = private_attr(m, "_get_fsdp_state", "torch", TORCH)()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = private_attr(state, "_fsdp_param_group", "torch", TORCH)
            groups = [one] if one is not None else []
        saved.append((m, state, private_attr(state, "_auto_reshard_after_forward", "torch", TORCH),
                      [(g, private_attr(g, "post_forward_mesh_info", "torch", TORCH)) for g in groups]))
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for m, state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            root_keeps = auto and private_attr(state, "_is_root", "torch", TORCH) is True
            for g, info in groups:
                g.post_forward_mesh_info = None if root_keeps else info
            m.reshard()


# ---------------------------------------------------------------------------------------------------- torchao

# torchao's float8 training wrappers of a weight (train/fp8.py): eval, samples and checkpoints use the
# high-precision tensor each wraps, which torchao keeps in a private attribute (named by the tensor-subclass
# protocol's __tensor_flatten__, its first inner tensor); torchao has no public unwrap
TORCHAO_WEIGHT_WRAPPERS = (
    Internal("torchao", "torchao.float8.fsdp_utils", ("WeightWithDynamicFloat8CastTensor",), TORCHAO,
             why="to read the high-precision weight inside a float8 linear's FSDP2 weight"),
    Internal("torchao", "torchao.prototype.moe_training.tensor",
             ("MXFP8TrainingWeightWrapperTensor", "Float8TrainingWeightWrapperTensor"), TORCHAO,
             why="to read the high-precision weight inside an MXFP8 linear's weight"),
)


def torchao_weight_wrappers() -> tuple[type, ...]:
    """The classes of torchao's weight wrappers whose modules are imported (a tensor of one can exist only
    then: an fp8 run imports the one its recipe uses), so that asking never imports torchao's prototypes."""
    found: list[type] = []
    for entry in TORCHAO_WEIGHT_WRAPPERS:
        if entry.module not in sys.modules:
            continue
        loaded = entry.load()
        found += loaded if isinstance(loaded, tuple) else [loaded]
    return tuple(found)


def torchao_inner_tensor(t):
    """The high-precision tensor torchao's weight wrapper `t` holds (its first inner tensor)."""
    import torch

    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0], None) if names else None
    if not isinstance(inner, torch.Tensor):
        raise CompatError(f"{installed('torchao')}: {type(t).__name__} holds no tensor first ({names}); checked "
                          f"on {TORCHAO}. Update raytune_ft/compat/ for this torchao.")
    return inner


# torch's cuDNN attention ops, forward and backward, each with its log-sum-exp (checked on torch 2.11-2.13)
TORCH_CUDNN_ATTENTION_OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")


@functools.cache
def cudnn_attention_ops() -> tuple[Callable, Callable] | None:
    """(forward, backward) of torch's private cuDNN attention ops, or None where this torch has none. CP's split
    attention (models/context_parallel/split_attention.py) needs the forward's log-sum-exp and a backward from a
    merged output and normaliser: SDPA's public call gives neither."""
    import torch

    try:
        return tuple(getattr(torch.ops.aten, name) for name in TORCH_CUDNN_ATTENTION_OPS)
    except (AttributeError, RuntimeError):
        return None
