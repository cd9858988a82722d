"""The data-parallel mesh as matrixfsdp sees it: which dimension shards (and owns), which
replicates, which is tensor-parallel, and the device and process group of each role.

[Note: mesh roles]
A :class:`MeshInfo` names three roles, as FSDP2's ``FSDPMeshInfo``/``HSDPMeshInfo`` do:

* **shard** (``dp_shard``): the ranks among which owners are planned; every parameter's owner is
  a rank of this dimension, and the reductions run over it;
* **replicate** (``dp_replicate``): copies of the shard group (HSDP); size 1 today;
* **tp**: tensor parallelism inside a rank's model shard; size 1 today.

The planner, both front-ends and checkpoints read meshes only through this object. Its sizes and
ranks come from the ``DeviceMesh`` alone (no process group), so the planner can use it offline;
``shard_group`` is the one place a front-end takes the process group of its role.

Only 1-D meshes (shard only) are accepted today: :func:`mesh_info` refuses others with a
``ValueError`` on every rank alike (the check reads the mesh's shape only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MeshInfo", "mesh_info", "default_mesh", "mesh_device", "backend_map", "backend_devices"]


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

        info = mesh_info(init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)), api="fully_shard")
        info.shard_size, info.shard_rank, info.replicate_size   # 4, this rank, 1
    """

    mesh: DeviceMesh
    #: the 1-D mesh of this rank's shard (owner) group
    shard_mesh: DeviceMesh

    @property
    def shard_size(self) -> int:
        return self.shard_mesh.size()

    @property
    def shard_rank(self) -> int:
        """This rank's coordinate in the shard dimension (the owner index space)."""
        return self.shard_mesh.get_local_rank()

    @property
    def replicate_size(self) -> int:
        return 1

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def shard_group(self) -> Any:
        """The process group of the shard dimension (created with the mesh)."""
        return self.shard_mesh.get_group()

    @property
    def device(self) -> torch.device:
        return mesh_device(self.mesh)


def mesh_info(mesh: Any, *, api: str, member: bool = True) -> MeshInfo:
    """Check ``mesh`` and name its roles; ``api`` prefixes the errors.

    Raises ``TypeError`` for a non-mesh and ``ValueError`` for a mesh of more than one dimension
    (HSDP and TP are not supported yet) or, with ``member`` (the front-ends), one this rank is not
    part of. The planner passes ``member=False``: it reads shapes only.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{api}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        shape = f" of shape {tuple(mesh.shape)}" if hasattr(mesh, "shape") else ""
        raise ValueError(
            f"{api}: mesh must be 1-D (the data-parallel shard dimension), got a {mesh.ndim}-D "
            f"mesh{shape}; pass mesh['dp_shard'] or a 1-D mesh"
        )
    if member and mesh.get_coordinate() is None:
        raise ValueError(f"{api}: this rank is not part of the mesh {mesh}")
    return MeshInfo(mesh=mesh, shard_mesh=mesh)
