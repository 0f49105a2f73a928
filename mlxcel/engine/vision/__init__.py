"""Vision-language (and audio-language) models through mlx-vlm, behind the engine interface.

`loader.load_vision_model` loads an mlx-vlm checkpoint directory; `engine.VisionEngine` runs
its requests with the same `submit`/`cancel`/`snapshot` surface as `TextEngine`, one slot at a
time; `inputs.VisionInputs` carries the decoded media of one request (images as PIL pictures,
audio as 16 kHz float arrays, video as frames or a staged file), never a user's string.
"""

from mlxcel.engine.vision.detect import vision_modalities
from mlxcel.engine.vision.inputs import VisionInputs

__all__ = ["VisionInputs", "vision_modalities"]
