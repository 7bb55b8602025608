"""Parallel degrees from the config, checked against the world size, and the device mesh."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, world_size: int) -> "ParallelDims":
        """dp_shard = -1 takes what the other degrees leave; the product must be the world."""
        for name, value in (("data_parallel_replicate_degree", dp_replicate),
                            ("tensor_parallel_degree", tp)):
            if value < 1:
                raise ValueError(f"[parallelism] {name} = {value}: must be >= 1")
        if dp_shard == -1:
            if world_size % (dp_replicate * tp):
                raise ValueError(
                    f"world size {world_size} is not divisible by data_parallel_replicate_degree "
                    f"({dp_replicate}) x tensor_parallel_degree ({tp})")
            dp_shard = world_size // (dp_replicate * tp)
        if dp_shard < 1 or dp_replicate * dp_shard * tp != world_size:
            raise ValueError(
                f"[parallelism] data_parallel_replicate_degree ({dp_replicate}) x "
                f"data_parallel_shard_degree ({dp_shard}) x tensor_parallel_degree ({tp}) = "
                f"{dp_replicate * dp_shard * tp}, but the world size is {world_size}")
        return cls(dp_replicate, dp_shard, tp, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The mesh is laid out (dp_replicate, dp_shard, tp), tp fastest: TP peers are adjacent
        ranks (one node) and share a data-parallel rank, so they read the same batch."""
        return rank // self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
