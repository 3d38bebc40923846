"""How gradients are laid out across the ranks of the scaler's process group, and how they are gathered.

A global norm sums per-rank contributions over the process group. A gradient whose values are held
identically by ``r`` ranks (DDP replicates every gradient over its data-parallel group; HSDP over the
replicate mesh dimension; tensor parallelism replicates norms over the TP dimension) must contribute
``1 / r`` of its ``sum |g|**p`` on each of them, so that one SUM counts it exactly once. Each
gradient's weight comes from, in this order:

1. **The gradient itself.** A DTensor gradient (FSDP2 ``fully_shard``, HSDP, tensor parallelism)
   carries its placements: the weight is ``1 / prod(mesh sizes of its Replicate dims)``; a
   ``Partial`` placement is an error (the gradient is not reduced yet). When its mesh covers only
   part of the scaler's process group, the gradient cannot say what the other ranks hold: copies (a layer
   left out of a tensor-parallel plan, sharded on the dp sub-mesh only) or other parameters
   (pipeline stages). That takes a registered ``grad_layout`` (``"replicated"``: copies on the
   ``world_size / mesh size`` ranks outside; ``"sharded"``: other parameters), else it is an error.
2. **The wrapped model**, registered once with
   [`GradScaler.register_model()`][distscaler.GradScaler.register_model]: DDP gives ``1 /
   size(ddp.process_group)``; FSDP1 gives 1 for its sharded strategies, ``1 / size(process_group)``
   for ``NO_SHARD`` and ``1 / replicate group size`` for ``HYBRID_SHARD``; an explicit
   ``grad_layout`` covers the rest of the module (a pipeline stage). A DTensor gradient inside DDP
   gets both factors.
3. **The scaler's ``grad_layout``** for every other plain tensor: ``"replicated"`` (weight
   ``1 / world_size``) or ``"sharded"`` (weight 1).

When none applies and the group has more than one rank, a norm would be a guess: it is an error
([`UnknownLayoutError`][distscaler.layouts.UnknownLayoutError]). FSDP1's flattened parameters are
recognised by their marker, and without a registered FSDP module they are an error too, since the
flat parameter does not say whether it is sharded, replicated (``NO_SHARD``) or both
(``HYBRID_SHARD``).

The overflow flag alone needs no weight: it is exact for every layout.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
from torch import nn

from ._param_table import ParamTable
from .errors import UnknownLayoutError
from .replica_check import ReplicaSet

__all__ = [
    "GRAD_LAYOUTS",
    "GradLayout",
    "UnknownLayoutError",
    "replication_weight",
]

GradLayout = Literal["replicated", "sharded"]
GRAD_LAYOUTS: tuple[str, ...] = get_args(GradLayout)

try:  # torch.distributed may be built without DTensor support
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover
    DTensor = Partial = Replicate = None  # type: ignore[assignment,misc]


class GroupKey(NamedTuple):
    """What gradients share to be checked in one multi-tensor launch and weighted alike."""

    device: torch.device
    dtype: torch.dtype
    #: 1 / (number of ranks of the process group holding the same values); 1.0 when unused.
    weight: float


#: Local gradients of one optimizer grouped by `GroupKey`, in
#: parameter order.
GradGroups = dict[GroupKey, list[torch.Tensor]]


def replication_weight(layout: str, world_size: int) -> float:
    """Weight of one rank's ``sum |g|**p`` in the group SUM: ``1 / world_size`` if replicated, else 1."""
    if layout == "replicated":
        return 1.0 / world_size
    return 1.0


def _is_fsdp1_flattened(param: torch.Tensor) -> bool:
    # FSDP1 marks its FlatParameters and, with use_orig_params=True, the original parameters.
    return bool(getattr(param, "_fsdp_flattened", False))


def _fsdp1_replicas(fsdp_module: nn.Module) -> int | None:
    """Ranks holding the same values of an FSDP1 module's gradients; None if it has no parameters."""
    handle = getattr(fsdp_module, "_handle", None)
    if handle is None:
        return None
    strategy = handle._sharding_strategy.name
    if strategy == "NO_SHARD":
        return dist.get_world_size(handle.process_group)
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return dist.get_world_size(fsdp_module._inter_node_pg)  # type: ignore[arg-type]
    return 1  # FULL_SHARD, SHARD_GRAD_OP: each rank holds its own shard


class LayoutResolver:
    """Per-parameter replication weights for the global norm (see the module docstring).

    Holds a registered model's parameters while the model lives; caches each DTensor gradient's
    weight per (mesh, placements).
    """

    def __init__(self, default: GradLayout | None) -> None:
        self.default = default
        self._registered = ParamTable()  # param -> (layout or weight, source)
        #: param -> the process group of the wrapper that replicates it (DDP, FSDP1 NO_SHARD or
        #: HYBRID_SHARD's replicate group), for the replica check.
        self._replica_groups = ParamTable()
        self._dtensor = ParamTable()  # param -> (mesh, placements, weight, mesh size)
        self._checked_meshes: set[tuple[int, int]] = set()
        #: Bumped by every registration, so that cached gradient groupings are rebuilt.
        self.version = 0
        #: Gradient groupings made once per optimizer
        #: (`group_grads()`), held weakly.
        self._groupings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # Registrations refer to live parameters: a copy (pickle, deepcopy) starts without them.
        return {"default": self.default}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["default"])  # type: ignore[misc]

    # ------------------------------------------------------------------ gathering

    def local_grads(
        self,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None,
        world_size: int,
        *,
        weighted: bool,
        allow_fp16: bool,
        needed: bool = True,
    ) -> tuple[GradGroups, tuple[torch.Tensor, ...]]:
        """This step's local gradients of ``optimizer`` and their parameters
        (`local_grads()`), with their replication
        weights in a group of ``world_size`` ranks when ``weighted`` (a norm is taken: sparse
        gradients are coalesced); nothing when not ``needed``. No collective, no host read.

        Raises:
            ValueError: ``allow_fp16`` is False and a gradient is fp16 (torch's wording).
            UnknownLayoutError: ``weighted``, more than one rank, and some layout is unknown.
        """
        if not needed:
            return {}, ()
        return local_grads(
            optimizer,
            self._groupings,
            resolver=self if weighted else None,
            world_size=world_size,
            group=group,
            allow_fp16=allow_fp16,
            coalesce_sparse=weighted,
        )

    # ------------------------------------------------------------------ registration

    def register_model(self, model: nn.Module, grad_layout: GradLayout | None = None) -> int:
        """Learn the layout of ``model``'s parameters from its wrappers. Returns how many it learnt.

        DDP and FSDP1 modules anywhere in ``model`` give their parameters' replication; with
        ``grad_layout`` every other parameter of ``model`` gets that layout's weight (for the
        process group's world size, resolved when the norm is taken). FSDP2 needs nothing: its
        gradients are DTensors. Later registrations of the same parameter win.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.nn.parallel import DistributedDataParallel as DDP

        learnt: dict[int, tuple[torch.Tensor, Any, str]] = {}
        groups: dict[int, Any] = {}
        if grad_layout is not None:
            for param in model.parameters():
                learnt[id(param)] = (param, grad_layout, f"grad_layout={grad_layout!r}")
        for module in model.modules():
            if isinstance(module, DDP):
                ddp_replicas = dist.get_world_size(module.process_group)
                for param in module.module.parameters():
                    learnt[id(param)] = (
                        param,
                        1.0 / ddp_replicas,
                        f"DDP over {ddp_replicas} ranks",
                    )
                    groups[id(param)] = module.process_group
            elif isinstance(module, FSDP):
                fsdp_replicas = _fsdp1_replicas(module)
                if fsdp_replicas is None:
                    continue
                handle: Any = module._handle
                flat = handle.flat_param
                source = f"FSDP1 {handle._sharding_strategy.name}"
                replicate_pg = _fsdp1_replicate_group(module)
                for view in [flat, *(flat._params or []), *(flat._shared_params or [])]:
                    learnt[id(view)] = (view, 1.0 / fsdp_replicas, source)
                    if replicate_pg is not None:
                        groups[id(view)] = replicate_pg
        for key, (tensor, weight, source) in learnt.items():
            self._registered.set(tensor, (weight, source), owner=model)
            self._replica_groups.set(tensor, groups.get(key), owner=model)
        self.version += 1
        return len(learnt)

    def register_params(self, params: Any, replicas: float, source: str) -> int:
        """Give each of ``params`` the weight ``1 / replicas`` (0 for ``math.inf``). Returns how many.

        For gradients whose layout only their framework knows (Megatron's main parameters: the
        ranks of its grad-stats group hold each value once, its copies of that group hold it
        again). Later registrations of the same parameter win.
        """
        count = 0
        for param in params:
            self._registered.set(param, (1.0 / replicas, source))
            self._replica_groups.set(param, None)
            count += 1
        self.version += 1
        return count

    # ------------------------------------------------------------------ weights

    def weight(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> float | None:
        """Weight of ``param``'s gradient on this rank, or None when its layout is unknown.

        Raises:
            UnknownLayoutError: a DTensor gradient is ``Partial``, lies on a mesh reaching outside
                the group, or on a mesh over only part of the group with nothing saying what the
                other ranks hold.
        """
        registered = self._registered.get(param)
        layout = registered[0] if registered is not None else self.default
        if DTensor is not None and isinstance(grad, DTensor):
            weight, mesh_size = self._dtensor_weight(param, grad, group)
            if mesh_size == world_size:
                # The mesh is the whole group: placements say everything (DDP on top of it, were
                # it so, multiplies).
                return weight * (layout if isinstance(layout, float) else 1.0)
            # A sub-mesh: the ranks outside it hold copies (FSDP2 + TP with a layer left out of
            # the TP plan) or other parameters (pipeline stages). Only the user can tell.
            if layout is None:
                raise _sub_mesh_error(grad, mesh_size, world_size)
            if isinstance(layout, float):
                return weight * layout
            copies = world_size / mesh_size if layout == "replicated" else 1.0
            return weight / copies
        if isinstance(layout, float):
            return layout
        if registered is None and _is_fsdp1_flattened(param):
            return None
        if layout is not None:
            return replication_weight(layout, world_size)
        return None

    def replica_set(
        self,
        param: torch.Tensor,
        grad: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        world_size: int,
    ) -> ReplicaSet | None:
        """The ranks holding the same values of ``param``'s gradient and this rank's place among
        them ([`distscaler.replica_check`][distscaler.replica_check]), or None when it is not
        replicated or its replicas are not known (sharded gradients; Megatron's registered
        parameters; a DTensor inside DDP). Host lookups only (no collective).

        Sources, as for the weights: a DTensor's ``Replicate`` mesh dimensions (when its mesh is
        the whole group); a registered DDP or FSDP1 wrapper's process group; ``"replicated"``
        (registered or the scaler's ``grad_layout``): the whole group.
        """
        if world_size < 2:
            return None
        sample = param if grad is None else grad
        registered = self._registered.get(param)
        if DTensor is not None and isinstance(sample, DTensor):
            if registered is not None:
                return None  # a DTensor inside DDP, or on a sub-mesh: not compared
            return _dtensor_replicas(sample)
        if registered is None:
            layout = self.default
            pg = None
        else:
            layout = registered[0]
            pg = self._replica_groups.get(param)
        if pg is not None:
            return _group_replicas(pg)
        if layout == "replicated":
            return _group_replicas(group)
        return None

    def _dtensor_weight(
        self, param: torch.Tensor, grad: Any, group: dist.ProcessGroup | None
    ) -> tuple[float, int]:
        """(1 / replicas within the mesh, number of ranks of the mesh)."""
        mesh, placements = grad.device_mesh, grad.placements
        cached = self._dtensor.get(param)
        if cached is not None and cached[0] is mesh and cached[1] == placements:
            return cached[2], cached[3]
        if any(isinstance(p, Partial) for p in placements):
            raise UnknownLayoutError(
                f"a gradient of shape {tuple(grad.shape)} has placements {placements}: a Partial "
                "gradient is not reduced yet, so its norm cannot be taken from local shards; "
                "redistribute it (grad.redistribute(placements=...)) before the scaler step"
            )
        self._check_mesh_in_group(mesh, group)
        replicas = 1
        for dim, placement in enumerate(placements):
            if isinstance(placement, Replicate):
                replicas *= mesh.size(dim)
        weight, mesh_size = 1.0 / replicas, mesh.size()
        self._dtensor.set(param, (mesh, placements, weight, mesh_size))
        return weight, mesh_size

    def _check_mesh_in_group(self, mesh: Any, group: dist.ProcessGroup | None) -> None:
        key = (id(mesh), id(group))
        if key in self._checked_meshes:
            return
        group_ranks = set(dist.get_process_group_ranks(group or dist.group.WORLD))  # type: ignore[arg-type]
        mesh_ranks = set(mesh.mesh.flatten().tolist())
        if not mesh_ranks <= group_ranks:
            raise UnknownLayoutError(
                f"a DTensor gradient lives on a device mesh over ranks {sorted(mesh_ranks)}, but the "
                f"scaler's process_group has ranks {sorted(group_ranks)}: the norm would miss the "
                "shards held outside it; pass a process_group that contains the whole mesh"
            )
        self._checked_meshes.add(key)


def _group_replicas(group: dist.ProcessGroup | None) -> ReplicaSet | None:
    """Every rank of ``group`` (None: WORLD) holds the same values."""
    try:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))  # type: ignore[arg-type]
        index = ranks.index(dist.get_rank())
    except (RuntimeError, ValueError, KeyError, AttributeError):  # a group not in c10d's tables
        return None
    return ReplicaSet(ranks, index) if len(ranks) > 1 else None


def _dtensor_replicas(grad: Any) -> ReplicaSet | None:
    """The ranks of a DTensor's mesh that differ from this one only on ``Replicate`` dims."""
    mesh, placements = grad.device_mesh, grad.placements
    dims = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    if not dims:
        return None
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    index: list[Any] = [slice(None) if d in dims else c for d, c in enumerate(coord)]
    ranks = tuple(int(r) for r in mesh.mesh[tuple(index)].flatten().tolist())
    if len(ranks) < 2:
        return None
    return ReplicaSet(ranks, ranks.index(dist.get_rank()))


def _fsdp1_replicate_group(fsdp_module: nn.Module) -> Any:
    handle = getattr(fsdp_module, "_handle", None)
    if handle is None:
        return None
    strategy = handle._sharding_strategy.name
    if strategy == "NO_SHARD":
        return handle.process_group
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return fsdp_module._inter_node_pg
    return None


def _sub_mesh_error(grad: Any, mesh_size: int, world_size: int) -> UnknownLayoutError:
    return UnknownLayoutError(
        f"a DTensor gradient of shape {tuple(grad.shape)} lies on a device mesh of {mesh_size} of "
        f"the scaler's process group ({world_size} ranks) (mesh {grad.device_mesh}), and nothing says "
        "whether the other ranks hold copies of it (a layer left out of a tensor-parallel plan) or "
        "other parameters (pipeline stages): put the parameter on the full mesh (Replicate on the "
        "other dimensions, as torchtitan does), or call scaler.register_model(module, "
        'grad_layout="replicated") for copies, or grad_layout="sharded" for other parameters'
    )


def _unknown_layout_error(unknown: list[torch.Tensor], world_size: int) -> UnknownLayoutError:
    fsdp1 = sum(_is_fsdp1_flattened(p) for p in unknown)
    shapes = ", ".join(str(tuple(p.shape)) for p in unknown[:3])
    more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
    hint = (
        "call scaler.register_model(model) with the DDP/FSDP-wrapped model, or pass "
        'grad_layout="replicated" (every rank holds the same gradients, as under DDP) or '
        '"sharded" (each rank holds different gradients, as a pipeline stage does) to GradScaler '
        "or to register_model"
    )
    if fsdp1:
        hint = (
            f"{fsdp1} of them are FSDP1 flat parameters, which do not tell their sharding "
            "strategy: call scaler.register_model(fsdp_model) once after wrapping; or " + hint
        )
    return UnknownLayoutError(
        f"cannot tell how the gradients of {len(unknown)} parameter(s) (shapes {shapes}{more}) are "
        f"laid out across the {world_size} ranks of the scaler's process group, so a global norm would be "
        f"a guess: {hint}"
    )


def collect_grads(
    optimizer: torch.optim.Optimizer,
    *,
    allow_fp16: bool,
    coalesce_sparse: bool,
    resolver: LayoutResolver | None = None,
    world_size: int = 1,
    group: dist.ProcessGroup | None = None,
    params_out: list[torch.Tensor] | None = None,
) -> GradGroups:
    """Group the optimizer's non-None local gradients by device, dtype and weight, in parameter order.

    DTensor gradients contribute their local shard (``_local_tensor``: what this rank holds, no
    communication). Sparse gradients are handled as ``torch.amp.GradScaler`` does: fp16 ones are
    coalesced (``.grad`` is replaced) and their ``_values()`` are checked. With ``coalesce_sparse``
    every sparse gradient is coalesced, which a norm needs (duplicate indices would otherwise be
    counted apart).

    Args:
        resolver: when given (a norm is to be taken), each group key carries the gradients'
            replication weight for a group of ``world_size`` ranks; otherwise every weight is 1.0.
        params_out: when given, receives the parameters of the returned gradients, in the order
            of the groups and of the gradients in them.

    Raises:
        ValueError: ``allow_fp16`` is False and a gradient is fp16 (torch's "Attempting to unscale FP16
            gradients.").
        UnknownLayoutError: ``resolver`` is given, ``world_size > 1`` and some gradients' layout is
            unknown (nothing has been changed then, except that sparse gradients may be coalesced).
    """
    # Plain tuples while looping (a NamedTuple per gradient costs more than the rest of the loop).
    groups: dict[tuple[torch.device, torch.dtype, float], list[torch.Tensor]] = {}
    owners: dict[tuple[torch.device, torch.dtype, float], list[torch.Tensor]] = {}
    unknown: list[torch.Tensor] = []
    weigh = resolver is not None and world_size > 1
    fp16 = torch.float16
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype is fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            weight = 1.0
            if weigh:
                assert resolver is not None
                found = resolver.weight(param, grad, world_size, group)
                if found is None:
                    unknown.append(param)
                    continue
                weight = found
            if DTensor is not None and isinstance(grad, DTensor):
                # The local shard itself (not a copy): in-place unscaling must reach the gradient.
                grad = grad._local_tensor
            if grad.is_sparse:
                if grad.dtype is fp16 or coalesce_sparse:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            key = (grad.device, grad.dtype, weight)
            same = groups.get(key)
            if same is None:
                groups[key] = same = []
                owners[key] = []
            same.append(grad)
            owners[key].append(param)
    if unknown:
        raise _unknown_layout_error(unknown, world_size)
    if params_out is not None:
        for owned in owners.values():
            params_out.extend(owned)
    return {GroupKey(*key): grads for key, grads in groups.items()}


_NoneType = type(None)


class GradGrouping:
    """An optimizer's parameters grouped once by (device, dtype, weight), for every later step.

    `collect_grads()` does the grouping (and the layout lookups)
    for every gradient at every step; a grouping does it once per optimizer and parameter set. Gradients
    are new tensors at every step after ``zero_grad(set_to_none=True)``, so the grouping keys on the
    parameters and fetches their ``.grad`` at each step: two list passes per group, no per-gradient
    lookup.
    """

    __slots__ = ("groups", "key", "keys", "params")

    def __init__(self, key: tuple, groups: list[tuple[GroupKey, list[torch.Tensor], bool]]) -> None:
        self.key = key
        #: (group key, parameters, whether their gradients are DTensors), in parameter order.
        self.groups = groups
        owners: dict[GroupKey, list[torch.Tensor]] = {}
        for group_key, params, _ in groups:
            owners.setdefault(group_key, []).extend(params)
        #: The group keys in the order `grads()` returns them.
        self.keys = list(owners)
        #: Every grouped parameter, in the order `grads()`
        #: returns their gradients.
        self.params: tuple[torch.Tensor, ...] = tuple(p for ps in owners.values() for p in ps)

    def grads(self) -> tuple[GradGroups, tuple[torch.Tensor, ...]] | None:
        """This step's local gradients, grouped, and their parameters in the same order
        (`params` itself when every parameter has a gradient);
        parameters without a gradient are left out.

        None when the gradients no longer match the grouping (a model moved or cast since: one
        gradient per group is checked), so that it is rebuilt.
        """
        out: GradGroups = {}
        some_missing = False
        for key, params, is_dtensor in self.groups:
            grads = [p.grad for p in params]
            if _NoneType in map(type, grads):
                some_missing = True
                grads = [g for g in grads if g is not None]
                if not grads:
                    continue
            if is_dtensor:
                grads = [g._local_tensor for g in grads]  # type: ignore[union-attr]
            first = grads[0]
            if first.dtype is not key.dtype or first.device != key.device:  # type: ignore[union-attr]
                return None
            same = out.get(key)
            out[key] = grads if same is None else [*same, *grads]  # type: ignore[assignment,list-item]
        if not some_missing:
            return out, self.params
        # A group left empty may have moved a key: put the keys back in the order of ``params``.
        out = {key: out[key] for key in self.keys if key in out}
        return out, tuple(p for p in self.params if p.grad is not None)

    def has_fp16(self) -> bool:
        """Whether any gradient group of the grouping is float16."""
        return any(key.dtype is torch.float16 for key, _, _ in self.groups)


def _grouping_key(optimizer: torch.optim.Optimizer, *extra: Any) -> tuple:
    return (*((id(g["params"]), len(g["params"])) for g in optimizer.param_groups), *extra)


def group_grads(
    optimizer: torch.optim.Optimizer,
    cache: weakref.WeakKeyDictionary,
    *,
    resolver: LayoutResolver | None = None,
    world_size: int = 1,
    group: dist.ProcessGroup | None = None,
    rebuild: bool = False,
) -> GradGrouping | None:
    """The optimizer's cached `GradGrouping`, rebuilt when its parameter
    set, the registered layouts or the group change; None when this step's gradients cannot be
    grouped (sparse ones: use `collect_grads()`).

    Args:
        cache: where groupings are kept, per optimizer (held weakly).
        resolver: when given (a norm is to be taken) and ``world_size > 1``, groups carry the
            replication weight of their gradients (see
            `collect_grads()`).
        rebuild: build a new grouping even if the cached one matches (its gradients did not).

    Raises:
        UnknownLayoutError: as `collect_grads()`, when a grouping is
            built.
    """
    weigh = resolver is not None and world_size > 1
    key = _grouping_key(optimizer, weigh, resolver.version if weigh else 0, world_size, id(group))  # type: ignore[union-attr]
    groupings = cache.get(optimizer)
    if groupings is None:
        groupings = {}
        # Nothing cached while traced: dynamo guards on the cache it saw empty, and a grouping stored
        # at the first compiled call would compile the phase again at the next.
        if not torch.compiler.is_compiling():
            cache[optimizer] = groupings
    grouping = groupings.get(weigh)
    if grouping is not None and grouping.key == key and not rebuild:
        return grouping
    groups: dict[tuple, list[torch.Tensor]] = {}
    unknown: list[torch.Tensor] = []
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            grad = param.grad
            if grad is not None and grad.is_sparse:
                return None
            sample = param if grad is None else grad
            is_dtensor = DTensor is not None and isinstance(sample, DTensor)
            weight = 1.0
            if weigh:
                found = resolver.weight(param, sample, world_size, group)  # type: ignore[union-attr]
                if found is None:
                    unknown.append(param)
                    continue
                weight = found
            local = sample._local_tensor if is_dtensor else sample  # type: ignore[union-attr]
            groups.setdefault((local.device, local.dtype, weight, is_dtensor), []).append(param)
    if unknown:
        raise _unknown_layout_error(unknown, world_size)
    grouping = GradGrouping(
        key, [(GroupKey(d, t, w), params, dt) for (d, t, w, dt), params in groups.items()]
    )
    groupings[weigh] = grouping
    return grouping


def local_grads(
    optimizer: torch.optim.Optimizer,
    groupings: weakref.WeakKeyDictionary,
    *,
    resolver: LayoutResolver | None,
    world_size: int,
    group: dist.ProcessGroup | None,
    allow_fp16: bool,
    coalesce_sparse: bool = False,
) -> tuple[GradGroups, tuple[torch.Tensor, ...]]:
    """This step's local gradients of ``optimizer``, grouped (with replication weights if a
    ``resolver`` is given, for a norm), and their parameters in the same order. Grouping is grouped
    once per optimizer and parameter set (`group_grads()`, cached in
    ``groupings``); sparse gradients take `collect_grads()` at every
    step.

    Raises:
        ValueError: ``allow_fp16`` is False and a gradient is fp16 (torch's wording).
        UnknownLayoutError: a ``resolver``, more than one rank, and some layout is unknown.
    """
    grouping = grouped = None
    for rebuild in (False, True):
        grouping = group_grads(
            optimizer, groupings, resolver=resolver, world_size=world_size, group=group, rebuild=rebuild
        )
        if grouping is None:
            break
        grouped = grouping.grads()
        if grouped is not None:
            break
    if grouping is None or grouped is None:  # sparse gradients: the per-gradient path
        params: list[torch.Tensor] = []
        groups = collect_grads(
            optimizer,
            allow_fp16=allow_fp16,
            coalesce_sparse=coalesce_sparse,
            resolver=resolver,
            world_size=world_size,
            group=group,
            params_out=params,
        )
        return groups, tuple(params)
    if not allow_fp16 and grouping.has_fp16():
        raise ValueError("Attempting to unscale FP16 gradients.")
    return grouped

