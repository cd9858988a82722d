"""The data-parallel mesh as matrixfsdp sees it: which dimension shards (and owns), which
replicates, which is tensor-parallel, and the device and process group of each role.

[Note: mesh roles]
A :class:`MeshInfo` names three roles, as FSDP2's ``FSDPMeshInfo``/``HSDPMeshInfo`` do:

* **shard** (``dp_shard``): the ranks among which owners are planned; every parameter's owner is
  a rank of this dimension, and the reductions run over it;
* **replicate** (``dp_replicate``): copies of the shard group (HSDP); every replica group has
  the same owner layout, and gradients are combined across replicas after the shard reduction;
* **tp**: tensor parallelism inside a rank's model shard: a ``("dp_shard", "tp")`` mesh, as
  torch's FSDP2 + TP pattern builds it, plans owners over ``dp_shard`` and gives each owner's TP
  row the matrices it owns (see [Note: TP hosts] in ``placement/tp_host.py``). Only the planner
  takes such a mesh; ``fully_shard`` takes ``mesh["dp_shard"]`` and finds the TP layout on the
  parameters ``parallelize_module`` made DTensors. HSDP x TP is the same with a 3-D
  ``("dp_replicate", "dp_shard", "tp")`` mesh: the planner takes it whole, ``fully_shard`` takes
  ``mesh["dp_replicate", "dp_shard"]`` (each TP column is an HSDP mesh of its own).

A 1-D mesh is the shard dimension alone. A 2-D mesh is HSDP, as torch's ``fully_shard`` takes it:
dimension 0 replicates, dimension 1 shards, so ``init_device_mesh(dev, (R, S),
mesh_dim_names=("dp_replicate", "dp_shard"))`` puts the ``S`` ranks of one node in a shard
group. The planner, both front-ends and checkpoints read meshes only through this object. Its
sizes come from the mesh's shape alone (no process group), so the planner can use it offline;
``shard_group``/``replicate_group`` are the one place a front-end takes the process groups of its
roles. A 3-D mesh must be named ``(dp_replicate, <shard>, tp)`` in that order (torchtitan's shard
dimension is ``"fsdp"``); other 3-D meshes and meshes of four or more dimensions are refused with a
``ValueError`` on every rank alike (the checks read the mesh's shape and names only).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: the dimension names of a data-parallel x tensor-parallel mesh (torch's FSDP2 + TP pattern; any
#: 2-D mesh whose dimension 1 is named "tp" is one, e.g. torchtitan's ["fsdp", "tp"])
TP_NAMES = ("dp_shard", "tp")
#: the dimension names of an HSDP x TP mesh (dimension 1 may have another name: torchtitan's "fsdp")
HSDP_TP_NAMES = ("dp_replicate", "dp_shard", "tp")

__all__ = ["TP_NAMES", "HSDP_TP_NAMES", "MeshInfo", "mesh_info", "default_mesh", "mesh_device", "backend_map",
           "backend_devices", "flat_dp_mesh", "mesh_tag"]


def mesh_tag(mesh: DeviceMesh) -> str:
    """A short name suffix that tells meshes apart by ranks, shape, dimension names and device
    type (``DeviceMesh`` compares by ranks and names only; the meshes matrixfsdp derives from two
    meshes over the same ranks must not collide). The same on every rank; local."""
    return hashlib.sha1(repr((mesh.mesh.flatten().tolist(), tuple(mesh.shape), mesh.mesh_dim_names,
                              mesh.device_type)).encode()).hexdigest()[:8]


def flat_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Every data-parallel rank of ``mesh`` as one 1-D mesh: ``mesh`` itself, or an HSDP mesh
    flattened (replica-major, so its group ranks are ``r * S + s``). The first call for a mesh is
    collective (it creates the group); every rank makes it at the same point."""
    if mesh.ndim == 1:
        return mesh
    return mesh._flatten(f"dp_all_{mesh_tag(mesh)}")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def backend_map(group: Any = None) -> dict[str, str]:
    """``{device type: backend}`` of the group (``"cpu:gloo,cuda:nccl"`` maps both; a bare
    backend name maps the devices torch assigns it by default; ``"undefined"`` maps none)."""
    out: dict[str, str] = {}
    for entry in dist.get_backend_config(group).split(","):
        dev, sep, backend = entry.partition(":")
        if sep:
            out[dev.strip()] = backend.strip().lower()
        else:
            name = entry.strip().lower()
            out.update({d: b for d, b in dist.Backend.default_device_backend_map.items() if b == name})
    return out


def backend_devices(group: Any = None) -> set[str]:
    """The device types the group's backend(s) communicate on."""
    return set(backend_map(group))


def default_mesh(api: str = "matrixfsdp") -> DeviceMesh:
    """A 1-D mesh over the default process group, on the accelerator when its backend serves one,
    else on the CPU (chosen by what the backend communicates on, not by its name)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{api}: torch.distributed is not initialized and no mesh was given")
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device_type = acc.type if acc is not None and acc.type in backend_devices() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """Roles of a data-parallel mesh (see [Note: mesh roles]).

    Example::

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
        info = mesh_info(mesh, api="fully_shard")
        info.shard_size, info.shard_rank, info.replicate_size   # 4, this rank's column, 2
    """

    mesh: DeviceMesh
    #: the 1-D mesh of this rank's shard (owner) group (``None`` for a planner-only view)
    shard_mesh: DeviceMesh | None
    #: the 1-D mesh of this rank's replicate group (HSDP), else ``None``
    replicate_mesh: DeviceMesh | None = None
    #: the tensor-parallel dimension's index in ``mesh`` (a ``("dp_shard", "tp")`` or
    #: ``("dp_replicate", "dp_shard", "tp")`` planner view): the last one
    tp_dim: int | None = None

    @property
    def is_hsdp(self) -> bool:
        return self.mesh.ndim == 2 and self.tp_dim is None

    @property
    def _dp_ndim(self) -> int:
        return self.mesh.ndim - (self.tp_dim is not None)

    @property
    def shard_size(self) -> int:
        return int(self.mesh.size(self._dp_ndim - 1))

    @property
    def replicate_size(self) -> int:
        return int(self.mesh.size(0)) if self._dp_ndim == 2 else 1

    @property
    def world_size(self) -> int:
        """Data-parallel ranks in all: ``replicate_size * shard_size`` (the gradient average's divisor)."""
        return self.shard_size * self.replicate_size

    @property
    def shard_rank(self) -> int:
        """This rank's coordinate in the shard dimension (the owner index space)."""
        return self._member(self.shard_mesh).get_local_rank()

    @property
    def replicate_rank(self) -> int:
        """This rank's coordinate in the replicate dimension (0 without HSDP)."""
        return self.replicate_mesh.get_local_rank() if self.replicate_mesh is not None else 0

    @property
    def tp_size(self) -> int:
        """The TP degree of each owner's row (1 without a ``"tp"`` dimension)."""
        return int(self.mesh.size(self.tp_dim)) if self.tp_dim is not None else 1

    @property
    def shard_group(self) -> Any:
        """The process group of the shard dimension (created with the mesh)."""
        return self._member(self.shard_mesh).get_group()

    @property
    def replicate_group(self) -> Any:
        """The process group of the replicate dimension (HSDP), else ``None``."""
        return self.replicate_mesh.get_group() if self.replicate_mesh is not None else None

    @property
    def dp_group(self) -> Any:
        """Every data-parallel rank's group (an HSDP mesh flattened; the first call is collective):
        the group of the agreements that must fail on every rank alike."""
        return flat_dp_mesh(self.mesh).get_group() if self.is_hsdp else self.shard_group

    @property
    def device(self) -> torch.device:
        return mesh_device(self.mesh)

    @staticmethod
    def _member(mesh: DeviceMesh | None) -> DeviceMesh:
        if mesh is None:
            raise ValueError("matrixfsdp: this mesh view was built for planning only (member=False)")
        return mesh


def mesh_info(mesh: Any, *, api: str, member: bool = True, hsdp: bool = True) -> MeshInfo:
    """Check ``mesh`` and name its roles; ``api`` prefixes the errors.

    Raises ``TypeError`` for a non-mesh and ``ValueError`` for a mesh of more than three
    dimensions, a 3-D mesh not named ``(dp_replicate, <shard>, tp)``, a 2-D mesh without dimension
    names or where ``hsdp`` is False (an API without HSDP), a ``("dp_shard", "tp")`` or 3-D mesh
    given to a front-end (they take ``mesh["dp_shard"]`` / ``mesh["dp_replicate", "dp_shard"]``),
    or, with ``member`` (the front-ends), one this rank is not part of. The planner passes
    ``member=False``: it reads shapes only.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{api}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    shape = f" of shape {tuple(mesh.shape)}" if hasattr(mesh, "shape") else ""
    if mesh.ndim == 3:
        return _hsdp_tp_info(mesh, api=api, member=member, hsdp=hsdp, shape=shape)
    if mesh.ndim == 2 and (mesh.mesh_dim_names or ("", ""))[1] == "tp":
        if member:
            dp = mesh.mesh_dim_names[0]
            raise ValueError(
                f"{api}: got the {tuple(mesh.mesh_dim_names)} mesh{shape}; pass its data-parallel "
                f"dimension, mesh[{dp!r}] (the TP layout is read from the parameters that "
                "parallelize_module(..., mesh['tp'], ...) made DTensors), and the whole mesh to "
                "plan_owners"
            )
        return MeshInfo(mesh=mesh, shard_mesh=None, tp_dim=1)
    if mesh.ndim not in (1, 2) or (mesh.ndim == 2 and not hsdp):
        allowed = ("a 1-D mesh (the data-parallel shard dimension), a 2-D HSDP mesh "
                   "(dp_replicate, dp_shard), a (dp_shard, tp) or a (dp_replicate, dp_shard, tp) "
                   "mesh") if hsdp else "1-D (the data-parallel shard dimension)"
        hint = "pass mesh['dp_shard'] or a 1-D mesh" if not hsdp or mesh.ndim > 2 else ""
        raise ValueError(f"{api}: mesh must be {allowed}, got a {mesh.ndim}-D mesh{shape}"
                         + (f"; {hint}" if hint else ""))
    if member and mesh.get_coordinate() is None:
        raise ValueError(f"{api}: this rank is not part of the mesh {mesh}")
    if mesh.ndim == 1:
        return MeshInfo(mesh=mesh, shard_mesh=mesh)
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"{api}: a 2-D (HSDP) mesh{shape} needs dimension names (dimension 0 replicates, "
            "dimension 1 shards); build it with init_device_mesh(device_type, (R, S), "
            "mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))"
        )
    if names[0] == "dp_shard" or names[1] == "dp_replicate":
        raise ValueError(
            f"{api}: dimension 0 of a 2-D mesh replicates and dimension 1 shards (as torch's HSDP), "
            f"but this mesh is named {tuple(names)}; build it as init_device_mesh(device_type, (R, S), "
            "mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))"
        )
    if not member:
        return MeshInfo(mesh=mesh, shard_mesh=None)
    return MeshInfo(mesh=mesh, shard_mesh=mesh[names[1]], replicate_mesh=mesh[names[0]])


def _hsdp_tp_info(mesh: DeviceMesh, *, api: str, member: bool, hsdp: bool, shape: str) -> MeshInfo:
    """A 3-D HSDP x TP mesh: the planner's view, or the front-ends' refusal (they take its
    data-parallel dimensions). The checks read names and shape only, so every rank raises alike."""
    names = tuple(mesh.mesh_dim_names or ())
    # dimension 0 replicates, 1 shards, 2 is TP, by position (as torch's HSDP): only the names
    # say which is which, so they are required; dimension 1 may carry another name ("fsdp")
    if (len(names) != 3 or names[0] != HSDP_TP_NAMES[0] or names[2] != HSDP_TP_NAMES[2]
            or names[1] in (HSDP_TP_NAMES[0], HSDP_TP_NAMES[2])):
        seen = names if names else "none"
        raise ValueError(
            f"{api}: a 3-D mesh must be HSDP x TP with its dimensions named {HSDP_TP_NAMES} in this "
            "order (dimension 0 replicates, 1 shards, 2 is tensor-parallel; dimension 1 may be "
            f"named otherwise, e.g. torchtitan's 'fsdp'), but this mesh{shape} has dimension names "
            f"{seen}; build it as init_device_mesh(device_type, (R, S, T), mesh_dim_names="
            f"{HSDP_TP_NAMES})"
        )
    if member or not hsdp:
        raise ValueError(
            f"{api}: got the {names} mesh{shape}; pass its data-parallel dimensions, "
            f"mesh[{names[0]!r}, {names[1]!r}] (the TP layout is read from the parameters that "
            "parallelize_module(..., mesh['tp'], ...) made DTensors), and the whole mesh to plan_owners"
        )
    return MeshInfo(mesh=mesh, shard_mesh=None, tp_dim=2)
