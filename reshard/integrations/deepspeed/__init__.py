"""reshard for DeepSpeed trainers: every rank's own ZeRO partitions as refit sources, nothing gathered.

    from reshard.integrations import deepspeed as ds_sources
    refit = Refit(group, precision="cast")
    ds_sources.add_sources(refit, engine)      # the DeepSpeedEngine of deepspeed.initialize, on every trainer rank
    ...                                        # the engine side registers its destinations
    refit.run()                                # after every optimizer step

Exports `add_sources` and `partition_source` (one ZeRO-3 parameter as a `(window, layout)` source, for
integrations that build their sources at every sync). ZeRO-3 partitions are `reshard.planner.FlatRangeLayout`s read
from `ds_tensor` itself (zero-copy where its storage allows); ZeRO-0/1/2 parameters, whole on every rank, are split
between the ranks by the same rule, so each byte leaves the trainer once. DeepSpeed itself is never imported here:
the partitions are read from the attributes DeepSpeed sets on each parameter. See `docs/frameworks.md`.

Importing this package registers ZeRO-3 parameters as a partition kind of the trainer side
(`reshard.integrations.trainer.add_partition_kind`): `reshard.integrations.trainer.parameter_source` gives any
integration (TRL's sync) a ZeRO-3 parameter as its `partition_source`.
"""

from reshard.integrations.deepspeed._sources import add_sources, partition_source
from reshard.integrations.trainer import add_partition_kind

add_partition_kind("deepspeed-zero3", lambda p: hasattr(p, "ds_tensor"), partition_source)

__all__ = ["add_sources", "partition_source"]
