"""Parallel degrees from the config, checked against the world size, and the device mesh."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.process import cover_new_groups


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    cp: int = 1

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, world_size: int,
                cp: int = 1) -> "ParallelDims":
        """dp_shard = -1 takes what the other degrees leave; the product must be the world."""
        for name, value in (("data_parallel_replicate_degree", dp_replicate),
                            ("tensor_parallel_degree", tp), ("context_parallel_degree", cp)):
            if value < 1:
                raise ValueError(f"[parallelism] {name} = {value}: must be >= 1")
        others = [("data_parallel_replicate_degree", dp_replicate)]
        others += [("context_parallel_degree", cp)] if cp > 1 else []
        others += [("tensor_parallel_degree", tp)]
        product = dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % product:
                raise ValueError(f"world size {world_size} is not divisible by "
                                 + " x ".join(f"{name} ({value})" for name, value in others))
            dp_shard = world_size // product
        if dp_shard < 1 or dp_shard * product != world_size:
            named = [others[0], ("data_parallel_shard_degree", dp_shard), *others[1:]]
            raise ValueError("[parallelism] " + " x ".join(f"{n} ({v})" for n, v in named)
                             + f" = {dp_shard * product}, but the world size is {world_size}")
        return cls(dp_replicate, dp_shard, tp, world_size, cp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def same_batch(self) -> int:
        """Ranks that read the same batch: the tensor- and context-parallel ones."""
        return self.cp * self.tp

    def dp_rank(self, rank: int) -> int:
        """The mesh is laid out (dp_replicate, dp_shard[, cp], tp), tp fastest: TP peers are
        adjacent ranks (one node), then CP peers; together they share a data-parallel rank, so
        they read the same batch (CP ranks each keep their part of its sequences)."""
        return rank // self.same_batch

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """(dp_replicate, dp_shard, tp), and with CP (dp_replicate, dp_shard, cp, tp). Its
        subgroups get the default group's timeout ([comm]; torch would give them the backend's
        default: components/process.py)."""
        if self.cp == 1:
            mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                    mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        else:
            mesh = init_device_mesh(device_type,
                                    (self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                    mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        cover_new_groups()
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The dimensions FSDP shards over (and HSDP replicates over). With CP it shards over
        dp_shard x cp as one dimension, "dp_shard_cp" (torchtitan's): the cp ranks hold the same
        weights, so they may as well split them, and FSDP's reduce-scatter then sums the
        gradients of their parts of the sequences. The flattened meshes are kept by the root
        mesh (built once, whatever the calls)."""
        if self.cp == 1:
            dp = mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]
        elif self.dp_replicate == 1:
            dp = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
        else:
            data = mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
            dp = data._unflatten(0, (self.dp_replicate, self.dp_shard * self.cp),
                                 ("dp_replicate", "dp_shard_cp"))
        cover_new_groups()  # a flattened dimension's group is a new one ([comm]'s timeout)
        return dp
