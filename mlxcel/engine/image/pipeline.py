"""Load an mflux pipeline from a checkpoint directory and run image jobs on it.

`load_image_model(path)` reads the family from `model_index.json` and the component sizes
from their `config.json` files, builds mflux's modules with those sizes, and fills them
through mflux's own weight and tokenizer loaders (both the diffusers layout and mflux's saved
layout). `ImageModel.generate(job)` runs the job's `n` images one after another (seed + i)
and returns PNG bytes; a callback sees every denoising step and can stop the job there.
Everything here runs on the calling thread: the image worker owns that thread.
"""

from __future__ import annotations

import functools
import inspect
import io
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import EngineError, InvalidRequestError, ModelLoadError
from mlxcel.engine.image.families import FLUX2_KLEIN, Z_IMAGE, ImageFamily, detect_family
from mlxcel.engine.image.families import read_json as _read_json
from mlxcel.engine.image.request import ImageRequest

log = logging.getLogger(__name__)

MAX_INPUT_PIXELS = 4096 * 4096
DEFAULT_IMG2IMG_STRENGTH = 0.4

StepCallback = Callable[[int, int], None]
"""Called after each denoising step with (steps done, steps in all) over the whole job."""


class ImageStoppedError(EngineError):
    """The job was stopped between two denoising steps (timeout or client gone)."""


@dataclass
class GeneratedPicture:
    """One output image."""

    png: bytes
    width: int
    height: int
    seed: int


def _silence_mflux_progress() -> None:
    """mflux draws a tqdm bar per image on stderr; mlxcel draws its own (CLI) or none."""
    import tqdm
    from mflux.models.common.config import config as config_module

    config_module.tqdm = functools.partial(tqdm.tqdm, disable=True)  # type: ignore[attr-defined]


def _matching(cls: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The entries of a checkpoint config that are constructor arguments of `cls`."""
    params = inspect.signature(cls.__init__).parameters
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key in params and key != "self" and not key.startswith("_"):
            out[key] = (
                tuple(value) if isinstance(value, list) and key == "axes_dims_rope" else value
            )
    return out


class _StepHook:
    """The one mflux in-loop callback of a model; each job sets what it calls."""

    def __init__(self) -> None:
        self.on_step: Callable[[], None] | None = None

    def call_in_loop(
        self, t: int, seed: int, prompt: str, latents: Any, config: Any, time_steps: Any
    ) -> None:
        if self.on_step is not None:
            self.on_step()


class ImageModel:
    """A loaded pipeline of one family."""

    def __init__(self, family: ImageFamily, pipeline: Any, name: str, path: Path) -> None:
        self.family = family
        self.pipeline = pipeline
        self.name = name
        self.path = path
        self._hook = _StepHook()
        pipeline.callbacks.register(self._hook)

    def check(self, job: ImageRequest) -> None:
        """Raise InvalidRequestError when `job` does not fit this family."""
        job.check()
        if len(job.images) > self.family.max_images:
            what = (
                "one input image (img2img)"
                if self.family.max_images == 1
                else (f"at most {self.family.max_images} input images")
            )
            raise InvalidRequestError(
                f"{self.family.name} models take {what}, got {len(job.images)}"
            )

    def strength_of(self, job: ImageRequest) -> float | None:
        """The image strength `job` runs with: its own, else DEFAULT_IMG2IMG_STRENGTH for an
        img2img-only family (an input picture would otherwise be drowned in noise)."""
        if not job.images:
            return None
        if job.strength is None and not self.family.edit:
            return DEFAULT_IMG2IMG_STRENGTH
        return job.strength

    def steps_of(self, job: ImageRequest) -> int:
        """Denoising steps one image of `job` runs (img2img skips the first ones)."""
        steps = job.steps or self.family.default_steps
        strength = self.strength_of(job)
        if strength is not None:
            return steps - max(1, int(steps * strength))
        return steps

    def generate(
        self,
        job: ImageRequest,
        *,
        on_step: StepCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[GeneratedPicture]:
        """Run `job`: `job.n` PNG images, the i-th with seed `job.seed + i`."""
        self.check(job)
        per_image = self.steps_of(job)
        total = per_image * job.n
        done = 0

        def step() -> None:
            nonlocal done
            done += 1
            if on_step is not None:
                on_step(done, total)
            if should_stop is not None and should_stop():
                raise ImageStoppedError(f"stopped after step {done} of {total}")

        with tempfile.TemporaryDirectory(prefix="mlxcel-image-") as folder:
            paths = _write_inputs(job.images, Path(folder))
            self._hook.on_step = step
            try:
                pictures = []
                for i in range(job.n):
                    if should_stop is not None and should_stop():
                        raise ImageStoppedError(f"stopped before image {i + 1} of {job.n}")
                    pictures.append(self._one(job, job.seed + i, paths))
                return pictures
            finally:
                self._hook.on_step = None

    def _one(self, job: ImageRequest, seed: int, paths: list[Path]) -> GeneratedPicture:
        steps = job.steps or self.family.default_steps
        guidance = self.family.default_guidance if job.guidance is None else job.guidance
        strength = self.strength_of(job)
        if self.family is Z_IMAGE:
            result = self.pipeline.generate_image(
                seed=seed,
                prompt=job.prompt,
                num_inference_steps=steps,
                width=job.width,
                height=job.height,
                guidance=guidance,
                image_path=paths[0] if paths else None,
                image_strength=strength,
                negative_prompt=job.negative_prompt,
            )
        elif paths:
            result = _edit_view(self.pipeline).generate_image(
                seed=seed,
                prompt=job.prompt,
                num_inference_steps=steps,
                width=job.width,
                height=job.height,
                guidance=guidance,
                image_paths=list(paths),
                image_strength=strength,
            )
        else:
            result = self.pipeline.generate_image(
                seed=seed,
                prompt=job.prompt,
                num_inference_steps=steps,
                width=job.width,
                height=job.height,
                guidance=guidance,
            )
        picture = result.image
        return GeneratedPicture(encode_png(picture), picture.width, picture.height, seed)


def _edit_view(klein: Any) -> Any:
    """The loaded FLUX.2-klein as mflux's edit pipeline, sharing its modules and state.

    mflux splits text-to-image (Flux2Klein) and reference editing (Flux2KleinEdit) into two
    classes over the same weights; the view is made once and kept on the model.
    """
    view = getattr(klein, "_mlxcel_edit_view", None)
    if view is None:
        import mlx.nn as nn
        from mflux.models.flux2.variants.edit.flux2_klein_edit import Flux2KleinEdit

        view = Flux2KleinEdit.__new__(Flux2KleinEdit)
        nn.Module.__init__(view)
        dict.update(view, klein)  # modules, arrays and dict state (the prompt cache)
        view.__dict__.update(klein.__dict__)
        klein.__dict__["_mlxcel_edit_view"] = view
    return view


def encode_png(picture: Any) -> bytes:
    """PNG bytes with no metadata, so the same pixels always give the same bytes."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def _write_inputs(images: list[bytes], folder: Path) -> list[Path]:
    """Decode each input (InvalidRequestError if it is not a picture) and write it as PNG."""
    from PIL import Image, UnidentifiedImageError

    paths = []
    for i, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(data)) as opened:
                if opened.width * opened.height > MAX_INPUT_PIXELS:
                    raise InvalidRequestError(
                        f"input image {i + 1} is {opened.width}x{opened.height}; "
                        "at most 4096x4096 pixels"
                    )
                picture = opened.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            if isinstance(exc, InvalidRequestError):
                raise
            raise InvalidRequestError(f"input image {i + 1} is not a readable image") from None
        path = folder / f"input-{i}.png"
        picture.save(path, format="PNG")
        paths.append(path)
    return paths


def check_input_image(data: bytes, label: str) -> None:
    """Raise InvalidRequestError when `data` is not a picture PIL can read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.verify()
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequestError(f"{label} is not a readable image (PNG, JPEG, WebP...)") from None


# --- loading ---------------------------------------------------------------------------


def resolve_image_path(ref: str) -> Path:
    """The checkpoint directory for `ref` (a local directory; ModelLoadError otherwise)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"image model {ref}: not a directory (give a diffusers snapshot dir)")
    raise ModelLoadError(f"image model {ref}: no such directory")


def load_image_model(ref: str) -> ImageModel:
    """Load the checkpoint directory `ref` with mflux (ModelLoadError on any failure)."""
    try:
        import mflux  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(
            f"image generation needs mflux: pip install 'mlxcel[image]' ({exc.name} is missing)"
        ) from None
    root = resolve_image_path(ref)
    family = detect_family(root)
    _silence_mflux_progress()
    started = time.perf_counter()
    try:
        pipeline = _load_z_image(root) if family is Z_IMAGE else _load_flux2_klein(root)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - mflux raises many kinds; one line for the user
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"image model {root.name}: cannot load ({text})") from exc
    _materialize(pipeline)
    log.info(
        "image model %s (%s) loaded in %.1f s",
        root.name,
        family.name,
        time.perf_counter() - started,
    )
    return ImageModel(family, pipeline, root.name, root)


def _materialize(pipeline: Any) -> None:
    """Evaluate every weight now: MLX streams are per thread, and the worker thread that
    runs the pipeline cannot evaluate arrays still pending on the loading thread's stream."""
    import mlx.core as mx

    mx.eval(pipeline.parameters())


def _load_z_image(root: Path) -> Any:
    """Z-Image through mflux's initializer steps, with the modules built at the saved sizes."""
    import mlx.nn as nn
    from mflux.models.common.compute_precision import ComputePrecision
    from mflux.models.common.config.model_config import ModelConfig
    from mflux.models.common.vae.block_decoder import VAEBlockDecoder
    from mflux.models.z_image.model.z_image_text_encoder.text_encoder import TextEncoder
    from mflux.models.z_image.model.z_image_transformer.transformer import ZImageTransformer
    from mflux.models.z_image.model.z_image_vae.vae import VAE
    from mflux.models.z_image.variants.z_image import ZImage
    from mflux.models.z_image.z_image_initializer import ZImageInitializer as Init

    base = "turbo" not in root.name.lower() and "z-image" in root.name.lower()
    config = ModelConfig.z_image() if base else ModelConfig.z_image_turbo()
    model = ZImage.__new__(ZImage)
    nn.Module.__init__(model)
    Init._init_config(model, config)
    weights = Init._load_weights(str(root))
    Init._init_tokenizers(model, str(root))
    model.vae = VAE()
    model.vae.decode_mode = VAEBlockDecoder.LOW_MEMORY
    model.transformer = ZImageTransformer(
        **_matching(ZImageTransformer, _read_json(root / "transformer" / "config.json"))
    )
    model.text_encoder = TextEncoder(
        **_matching(TextEncoder, _read_json(root / "text_encoder" / "config.json"))
    )
    Init._apply_weights(model, weights, None)
    Init._apply_lora(model, None, None, True, weights)
    model.float32 = False
    model.transformer.set_float32(False)
    model.compute_precision = ComputePrecision(None)
    return model


def _load_flux2_klein(root: Path) -> Any:
    """FLUX.2-klein through mflux's own loader, the sizes given as model-config overrides."""
    from mflux.models.common.config.model_config import ModelConfig
    from mflux.models.flux2.model.flux2_text_encoder.qwen3_text_encoder import Qwen3TextEncoder
    from mflux.models.flux2.model.flux2_transformer.transformer import Flux2Transformer
    from mflux.models.flux2.variants.txt2img.flux2_klein import Flux2Klein

    transformer = _matching(Flux2Transformer, _read_json(root / "transformer" / "config.json"))
    encoder = _matching(Qwen3TextEncoder, _read_json(root / "text_encoder" / "config.json"))
    nine_b = transformer.get("num_attention_heads") == 32
    name = root.name.lower()
    if "base" in name:
        config = ModelConfig.flux2_klein_base_9b() if nine_b else ModelConfig.flux2_klein_base_4b()
    else:
        config = ModelConfig.flux2_klein_9b() if nine_b else ModelConfig.flux2_klein_4b()
    sized = ModelConfig(
        priority=config.priority,
        aliases=list(config.aliases),
        model_name=str(root),
        base_model=config.base_model,
        controlnet_model=None,
        custom_transformer_model=None,
        num_train_steps=config.num_train_steps,
        max_sequence_length=config.max_sequence_length,
        supports_guidance=config.supports_guidance,
        requires_sigma_shift=config.requires_sigma_shift,
        transformer_overrides={**config.transformer_overrides, **transformer},
        text_encoder_overrides={**config.text_encoder_overrides, **encoder},
        sigma_base_shift=config.sigma_base_shift,
        sigma_max_shift=config.sigma_max_shift,
        sigma_base_seq_len=config.sigma_base_seq_len,
        sigma_max_seq_len=config.sigma_max_seq_len,
        sigma_shift_terminal=config.sigma_shift_terminal,
        supports_kv_cache=config.supports_kv_cache,
    )
    return Flux2Klein(model_path=str(root), model_config=sized)


__all__ = [
    "FLUX2_KLEIN",
    "GeneratedPicture",
    "ImageModel",
    "ImageStoppedError",
    "StepCallback",
    "check_input_image",
    "encode_png",
    "load_image_model",
]
