"""One model across several machines, on MLX's distributed engine (`mlx.launch`).

Every rank of a group loads only its shard of the model (`shard.py`: tensor parallel by
the model's own `shard(group)`, or pipeline parallel by its layers); rank 0 schedules, and
every step's inputs go from it to the other ranks (`lane.py`), so each rank runs the same
batched forwards of the one engine core (`mlxcel.engine.text.scheduler.TextEngine`).
`group.py` finds the group a process was launched into.
"""
