"""Vision-language (and audio-language) models through mlx-vlm, behind the engine interface.

`loader.load_vision_model` loads an mlx-vlm checkpoint directory; `engine.VisionEngine` is the
engine core (`TextEngine`) over it, continuous batching included: each request's media
prefill alone (`language_step.prefill_media`), then every slot decodes in one batched forward
of the language model (`language_step.LanguageStep`); `prepared.PreparedPrompt` is a request
once the processor ran, with its prompt-cache key by media content; `inputs.VisionInputs`
carries the decoded media of one request (images as PIL pictures, audio as 16 kHz float
arrays, video as frames or a staged file), never a user's string.
"""

from mlxcel.engine.vision.detect import vision_modalities
from mlxcel.engine.vision.inputs import VisionInputs

__all__ = ["VisionInputs", "vision_modalities"]
