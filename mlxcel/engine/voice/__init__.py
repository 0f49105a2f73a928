"""Voice conversation pieces with no model in them, for `/v1/realtime`'s cascade: G.711
codecs (`g711`), voice activity detection that turns a stream of audio into turns (`vad`),
and a splitter of streamed text into sentences to speak (`sentences`). Nothing here imports
MLX; each is cheap enough to run on the event loop for the chunks a client sends."""
