"""Router mode: several models behind one `mlxcel serve`, as llama-server's `--models-dir`.

`catalog` finds the models (a directory, a preset file) and the settings each one runs
with; `pool` loads them on demand (least recently used out at `--models-max`, idle ones out
when memory would not fit); `dispatch` routes each request to its model's own app (the
single-model app of `mlxcel.server.app`, built on the model's `ServerState` by
`mlxcel.server.boot`); `routes` answers the router's own routes (`/models`, `/models/load`,
`/models/unload`, `/health`, `/props`); `serve` hands all of it to the runner.
"""
