"""Chat messages with images -> a multimodal prompt's token ids and its image rows (issue 46):
Gemma 3, Gemma 4, Idefics3 / SmolVLM, Mistral 3 and Qwen-VL (the model's vision module, `core.vision.VISION_MODULES`,
decides the placeholder and its expansion).

A message's content may be a list of parts, OpenAI-, Anthropic- and Responses-style:

    {"type": "text", "text": "..."}                         (also "input_text")
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (or the url alone)
    {"type": "input_image", "image_url": "data:..."}        (the Responses API)
    {"type": "image", "image": PIL image | bytes | pathlib.Path | uint8 array}
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "..."}}

Only data URLs are read (no network: an http(s) URL is refused). The messages are
rendered with the chat template, given each image as {"type": "image"} (Gemma 3's template
writes `<start_of_image>` for it); a template that does not write one placeholder per image
(one that only knows string content) gets each message's parts joined into a string with
the placeholder in each image's place instead. Each placeholder becomes Gemma3Processor's
"\\n\\n<start_of_image>" + image tokens + "<end_of_image>\\n\\n", the text between tokenized
piece by piece (the image tokens are special tokens, so a tokenizer splits there anyway),
the image ids inserted as ids: the prompt does not depend on whether the tokenizer knows
the image strings. The images are preprocessed (loading/images.py) and encoded by the
model's vision tower (`encode_images_compiled`) into rows [N * mm, H].

Errors are ImageError (a ValueError): images to a model without an image path, more than
`max_images`, a bad data URL or base64, a media type that is not an image, an undecodable
image, more than `max_pixels` pixels.

Idefics3 / SmolVLM: the placeholder is `<image>` (what their chat templates write); each
image is preprocessed into tiles (loading/images.idefics3_tiles: rows x cols tiles and the
global image), and the placeholder becomes Idefics3Processor's expansion
(core/vision/idefics3.prompt_segments): its text pieces tokenized, its image-token runs
inserted as ids, one run of tokens_per_tile per tile. `spans` are those runs (several per
image); an image's rows are all its tiles' rows, in order.

Qwen2(.5)-VL: the placeholder is "<|vision_start|><|image_pad|><|vision_end|>" (what its
chat template writes); each image is resized to multiples of 28 pixels and cut into
patches (loading/images_qwen2_vl.py), its <|image_pad|> becomes t * h * w / merge^2 image
tokens, and the prompt carries its M-RoPE offsets (`ImagePrompt.rope_offsets`), which
every prefill piece before the last image's end passes to the step (`step_images`).
Qwen3-VL: the same prompt (16-pixel patches: multiples of 32 pixels), and each image's
DeepStack rows (`ImagePrompt.deepstack`) travel with its rows into the step.

Mistral 3 (Pixtral): the placeholder is "[IMG]" (what its chat template writes); each
image is resized to fit the processor's longest edge in multiples of patch_size *
spatial_merge_size pixels (loading/images_pixtral.py, no tiling), and the placeholder
becomes its rows of image tokens, each row ended by [IMG_BREAK], the last by [IMG_END]
(core/vision/pixtral.prompt_ids; the break / end ids from the tokenizer). `spans` are the
rows' runs; the images are encoded one at a time (one compiled trace per image-size bucket:
core/buckets.size_bucket).

Gemma 4: the placeholder is "<|image|>" (what its chat template writes); each image is
resized within its soft-token budget keeping its aspect ratio and cut into patches
(loading/images_gemma4.py), and the placeholder becomes "<|image>" + its soft tokens +
"<image|>" (core/vision/gemma4.py); images encoded one at a time, as Mistral 3's.
"""

from __future__ import annotations

import base64
import binascii
import collections
import copy
import hashlib
import io
import threading
from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from fx_engine.loading.images import ImageError, preprocess_crops

#: most images in one request (Gemma 3: 256 tokens each; Idefics3: up to rows x cols + 1 tiles each)
MAX_IMAGES = 16
#: most pixels in one decoded image (before resizing)
MAX_PIXELS = 8192 * 8192
IMAGE_TYPES = ("image", "image_url", "input_image")
TEXT_TYPES = ("text", "input_text")
#: the encoded formats Pillow reads that a request may declare
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "image/tiff")


class ImagePrompt(NamedTuple):
    """A prompt with images: its ids, the images' embedding rows [N * mm, H] in prompt
    order, and the image-token runs [start, end) in `ids` (Gemma 3: one per image;
    Idefics3: one per tile)."""

    ids: list[int]
    rows: mx.array
    spans: list[tuple[int, int]]
    digests: tuple[str, ...] = ()  # each image's content hash (sha256 of its pixels)
    image_tokens: tuple[int, ...] = ()  # each image's number of image tokens (its rows)
    # Qwen2(.5)-VL (M-RoPE): each token's three rotary ids minus its cache position, int32
    # [3, len(ids)] (core/vision/qwen2_vl.rope_offsets: zero from `rope_until` on), and the
    # prompt's rope_delta; None / 0: plain RoPE
    rope_offsets: Any = None
    rope_delta: int = 0
    # Qwen3-VL: the images' DeepStack features [L, N * mm, H], rows parallel to `rows`
    # (core/vision/qwen3_vl.py); None: none
    deepstack: Any = None
    # whether a prefill piece must hold whole images: Gemma 3's image tokens attend to each
    # other (bidirectionally), so an image's run is prefilled in one piece; the causal
    # families' (Idefics3, Qwen-VL, Mistral 3) runs are cut like text
    whole: bool = False

    @property
    def rope_until(self) -> int:
        """The index past the last token whose rotary ids are not its cache position."""
        if self.rope_offsets is None:
            return 0
        cols = np.flatnonzero(np.any(np.asarray(self.rope_offsets) != 0, axis=0))
        return int(cols[-1]) + 1 if cols.size else 0


def has_images(prompt: Any) -> bool:
    """Whether a prompt is chat messages with at least one image part."""
    if not isinstance(prompt, (list, tuple)):
        return False
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple)) and any(
                isinstance(part, dict) and part.get("type") in IMAGE_TYPES for part in content):
            return True
    return False


def _data_url(url: Any, what: str) -> bytes:
    if not isinstance(url, str):
        raise ImageError(f"{what}: the image url must be a string, got {type(url).__name__}")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ImageError(f"{what}: only data URLs (data:image/png;base64,...) are read, not {scheme!r} URLs")
    head, sep, data = url[5:].partition(",")
    if not sep:
        raise ImageError(f"{what}: a data URL needs a comma before its data")
    parts = head.split(";")
    media = parts[0].strip().lower()
    if media and media not in MEDIA_TYPES:
        raise ImageError(f"{what}: unsupported media type {media!r} (supported: {', '.join(MEDIA_TYPES)})")
    if "base64" not in parts[1:]:
        raise ImageError(f"{what}: the data URL must be base64-encoded (data:<type>;base64,<data>)")
    return _b64(data, what)


def _b64(data: Any, what: str) -> bytes:
    if not isinstance(data, str):
        raise ImageError(f"{what}: base64 data must be a string, got {type(data).__name__}")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what}: invalid base64 data ({e})") from e


def _image_of(part: dict[str, Any], what: str) -> Any:
    """The image a part carries: encoded bytes, or a PIL image / path / array as given."""
    kind = part.get("type")
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        return _data_url(url, what)
    if "image" in part:
        return part["image"]
    source = part.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64":
            media = str(source.get("media_type", "")).lower()
            if media not in MEDIA_TYPES:
                raise ImageError(f"{what}: unsupported media type {media!r} (supported: {', '.join(MEDIA_TYPES)})")
            return _b64(source.get("data"), what)
        if source.get("type") == "url":
            return _data_url(source.get("url"), what)
        raise ImageError(f"{what}: image source type {source.get('type')!r} is not supported (base64, url)")
    if "url" in part:
        return _data_url(part["url"], what)
    raise ImageError(f"{what}: an image part needs 'image', 'image_url' or 'source'")


def _check_pixels(image: Any, what: str, max_pixels: int) -> None:
    """Refuse a decoded image over `max_pixels` before it is decoded in full (PIL opens lazily)."""
    size = None
    if isinstance(image, (bytes, bytearray)):
        import PIL.Image

        try:
            with PIL.Image.open(io.BytesIO(bytes(image))) as im:
                size = im.size
        except Exception as e:  # PIL.UnidentifiedImageError, DecompressionBombError, ...
            raise ImageError(f"{what}: not a readable image ({e})") from e
    elif hasattr(image, "size") and isinstance(getattr(image, "size"), tuple):
        size = image.size
    elif hasattr(image, "shape"):
        size = tuple(image.shape[:2])
    if size is not None and size[0] * size[1] > max_pixels:
        raise ImageError(f"{what}: {size[0]}x{size[1]} pixels is more than the {max_pixels} allowed per image")


def split_messages(messages: Sequence[dict[str, Any]], max_images: int = MAX_IMAGES,
                   max_pixels: int = MAX_PIXELS) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages whose image parts are {"type": "image"} and text parts {"type": "text"},
    the images in order). ImageError for a bad part."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            what = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_TYPES:
                images.append(_image_of(part, what))
                if len(images) > max_images:
                    raise ImageError(f"{what}: more than {max_images} images in one request")
                _check_pixels(images[-1], what, max_pixels)
                parts.append({"type": "image"})
            elif kind in TEXT_TYPES:
                text = part.get("text")
                if not isinstance(text, str):
                    raise ImageError(f"{what}: a text part needs a string 'text'")
                parts.append({"type": "text", "text": text})
            else:
                raise ImageError(f"{what}: unsupported content part type {kind!r} (text, image_url, image, "
                                 "input_image)")
        out.append({**m, "content": parts})
    return out, images


def _flattened(messages: list[dict[str, Any]], boi: str) -> list[dict[str, Any]]:
    """Each list content joined into a string, `boi` in each image's place (text parts
    trimmed, as Gemma 3's template does)."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            m = {**m, "content": "".join(boi if p["type"] == "image" else p["text"].strip() for p in c)}
        out.append(m)
    return out


class EncoderCache:
    """The vision tower's output per image content (its pixels' digest): [mm, H] rows,
    least recently used first out under a byte budget. Thread-safe (the engine's callers
    encode in their own threads); rows are stored evaluated."""

    def __init__(self, max_bytes: int = 256 << 20):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"encoder cache bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = self.misses = 0
        self._rows: collections.OrderedDict[str, mx.array] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, digest: str) -> mx.array | None:
        with self._lock:
            rows = self._rows.get(digest)
            if rows is None:
                self.misses += 1
                return None
            self._rows.move_to_end(digest)
            self.hits += 1
            return rows

    def put(self, digest: str, rows: mx.array) -> None:
        with self._lock:
            if digest in self._rows or rows.nbytes > self.max_bytes:
                return
            self._rows[digest] = rows
            self.nbytes += rows.nbytes
            while self.nbytes > self.max_bytes:
                _, old = self._rows.popitem(last=False)
                self.nbytes -= old.nbytes


def _vision_module(vision: Any) -> Any:
    from fx_engine.core.vision import VISION_MODULES

    return VISION_MODULES[vision.config.model_type]


def _encode(vision: Any, pixels: Sequence[np.ndarray], digests: Sequence[str], cache: EncoderCache | None) -> mx.array:
    """The images' rows [sum of tiles * mm, H], evaluated: the cached ones from `cache`, the
    others encoded together (the vision module's `encode_images_compiled`) and cached.
    pixels: per image, its tiles [T, C, S, S] (Gemma 3: T = 1)."""
    encode = _vision_module(vision).encode_images_compiled
    have = [cache.get(d) if cache is not None else None for d in digests]
    todo = [i for i, r in enumerate(have) if r is None]
    if todo:
        batch = np.concatenate([pixels[i] for i in todo], axis=0)
        out = encode(vision, mx.array(batch))
        mx.eval(out)
        at = 0
        for i in todo:
            t = int(pixels[i].shape[0])
            have[i] = mx.contiguous(out[at:at + t].reshape(-1, out.shape[-1]))
            at += t
        mx.eval(*(have[i] for i in todo))
        if cache is not None:
            for i in todo:
                cache.put(digests[i], have[i])
    rows = mx.concatenate(have, axis=0) if len(have) > 1 else have[0]
    mx.eval(rows)  # (evaluated here: the engine's thread reads them; no lazy graph crosses threads)
    return rows


def _placeholder_pieces(text: str, placeholder: str, n_images: int) -> list[str]:
    """The rendered prompt's text around its image placeholders (n_images + 1 pieces), or
    ImageError when it has another number of them."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 != n_images:
        raise ImageError(f"the rendered prompt has {len(pieces) - 1} {placeholder} placeholder(s) for "
                         f"{n_images} image(s) (does a text part contain the placeholder?)")
    return pieces


def _text_ids(tok: Any, piece: str) -> list[int]:
    """A text piece between image runs, tokenized on its own (no special tokens added)."""
    return list(tok.encode(piece, add_special_tokens=False)) if piece else []


def _encode_each(inputs: Sequence[Any], digests: Sequence[str], cache: EncoderCache | None,
                 encode_one: Any) -> list[mx.array]:
    """Each image's encoding, evaluated: taken from `cache` by its digest, else
    `encode_one(input)` alone (one compiled trace per image-size bucket: an image encodes alike
    alone or with others) and cached."""
    have = []
    for item, digest in zip(inputs, digests):
        rows = cache.get(digest) if cache is not None else None
        if rows is None:
            rows = mx.contiguous(encode_one(item))
            mx.eval(rows)
            if cache is not None:
                cache.put(digest, rows)
        have.append(rows)
    return have


def image_prompt(model: Any, messages: Sequence[dict[str, Any]], *, max_images: int = MAX_IMAGES,
                 max_pixels: int = MAX_PIXELS, chat_template: str | None = None,
                 cache: EncoderCache | None = None) -> ImagePrompt:
    """The prompt of chat `messages` with images, for `model` (a loaded multimodal Model).
    cache: the images' encodings by content (an image seen before is not encoded again)."""
    norm, images = split_messages(messages, max_images, max_pixels)
    if not images:
        raise ImageError("no images in the messages")
    kw = {} if chat_template is None else {"chat_template": chat_template}
    return image_prompt_from_text(model, render_with_images(model, norm, len(images), **kw), images, cache=cache)


def render_with_images(model: Any, messages: list[dict[str, Any]], n_images: int, **template_kwargs: Any) -> str:
    """`split_messages`' messages rendered by the chat template (`template_kwargs`: its
    chat_template and variables), one placeholder per image (`image_placeholder`); a
    template that does not write one per image part (one that only knows string content)
    gets each message's parts joined into a string, the placeholder in each image's place."""
    mark = image_placeholder(model)
    tok = model.tokenizer
    try:
        text = tok.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=True, tokenize=False,
                                       **template_kwargs)
    except Exception:  # a template that only knows string content (jinja's TypeError, ...): below
        text = None
    if text is None or text.count(mark) != n_images:
        text = tok.apply_chat_template(_flattened(messages, mark), add_generation_prompt=True, tokenize=False,
                                       **template_kwargs)
    return text


def _vision_of(model: Any) -> Any:
    vision = getattr(model, "vision", None)
    if vision is None or getattr(model, "image_processor", None) is None:
        kind = getattr(model.config, "model_type", "this")
        path = str(getattr(model, "path", "") or "")
        hint = ("a GGUF file holds the text model only: load its mmproj file too (load(..., mmproj=FILE), "
                "--mmproj FILE; Gemma 3, Gemma 4, Idefics3 / SmolVLM, Mistral 3, Qwen2(.5)-VL, Qwen3-VL)" if path.lower().endswith(".gguf") else
                "a text-only model; use a multimodal checkpoint: a Gemma 3, Gemma 4, Idefics3, SmolVLM, Qwen2-VL, "
                "Qwen2.5-VL, Qwen3-VL or Mistral 3 folder with vision_config")
        raise ImageError(f"images were given, but {kind} model {path} has no vision tower ({hint})")
    return vision


def image_placeholder(model: Any) -> str:
    """The text a rendered prompt holds in each image's place for `model` (what
    `image_prompt_from_text` splits at): Gemma 3's `<start_of_image>`, Idefics3 / SmolVLM's
    `<image>`, Qwen2(.5)-VL's `<|vision_start|><|image_pad|><|vision_end|>`. ImageError for
    a model without an image path."""
    return _vision_of(model).config.placeholder


def image_prompt_from_text(model: Any, text: str, images: Sequence[Any], *,
                           cache: EncoderCache | None = None) -> ImagePrompt:
    """The prompt of already rendered `text` (a chat template's output: one
    placeholder per image (`image_placeholder`), in order) with `images` (PIL images,
    encoded bytes, paths, uint8 arrays): the seam for callers that render the template
    themselves (the server: tools, template switches). Enter it into `Engine.submit` as the
    prompt."""
    from fx_engine.core.vision.gemma3 import BOI_TEXT, image_token_runs

    vision = _vision_of(model)
    images = list(images)
    if not images:
        raise ImageError("no images given")
    cfg = vision.config
    if cfg.model_type in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        return _qwen2_vl_prompt(model, vision, text, images, cache)
    if cfg.model_type == "mistral3":
        return _pixtral_prompt(model, vision, text, images, cache)
    if cfg.model_type == "gemma4":
        return _gemma4_prompt(model, vision, text, images, cache)
    if cfg.model_type != "gemma3":
        return _idefics3_prompt(model, vision, text, images, cache)
    tok = model.tokenizer
    pieces = _placeholder_pieces(text, BOI_TEXT, len(images))
    run = [cfg.boi_token_index] + [cfg.image_token_index] * cfg.mm_tokens_per_image + [cfg.eoi_token_index]
    # each image: the image, then its pan-and-scan crops (none unless the folder turns it on)
    pixels = [preprocess_crops(im, model.image_processor, f"image {i}") for i, im in enumerate(images)]
    segments: list[str | None] = [pieces[0]]  # text, and None for a run of image tokens
    for p, piece in zip(pixels, pieces[1:]):
        segments += _gemma3_image_segments(p.shape[0] - 1) + [piece]
    ids: list[int] = []
    text_run = ""
    for seg in segments + [None]:  # (adjacent text pieces tokenized together, as one string is)
        if seg is not None:
            text_run += seg
            continue
        ids += list(tok.encode(text_run, add_special_tokens=False)) if text_run else []
        text_run = ""
        ids += run
    ids = ids[:-len(run)]  # (the sentinel's run)
    spans = image_token_runs(ids, cfg, sum(p.shape[0] for p in pixels))
    digests = tuple(hashlib.sha256(np.ascontiguousarray(p).tobytes()).hexdigest() for p in pixels)
    return ImagePrompt(ids, _encode(vision, pixels, digests, cache), spans, digests,
                       tuple(cfg.mm_tokens_per_image * p.shape[0] for p in pixels), whole=True)


def _gemma3_image_segments(crops: int) -> list[str | None]:
    """What Gemma3Processor writes for one image placeholder (None: a run of image tokens,
    boi + image tokens + eoi): "\n\n" run "\n\n"; with pan-and-scan crops, "Here is the
    original image " + that + " and here are some crops to help you see better " + the
    crops' runs joined by " "."""
    one: list[str | None] = ["\n\n", None, "\n\n"]
    if not crops:
        return one
    out: list[str | None] = ["Here is the original image ", *one, " and here are some crops to help you see better "]
    for c in range(crops):
        out += ([" "] if c else []) + one
    return out


def _idefics3_prompt(model: Any, vision: Any, text: str, images: list[Any], cache: EncoderCache | None) -> ImagePrompt:
    """Idefics3 / SmolVLM's `image_prompt_from_text` (the module docstring)."""
    from fx_engine.core.vision import idefics3
    from fx_engine.loading.images import Idefics3ProcessorConfig, idefics3_tiles

    cfg = vision.config
    rules = model.image_processor
    if not isinstance(rules, Idefics3ProcessorConfig):  # a folder without preprocessor_config.json
        rules = Idefics3ProcessorConfig(longest_edge=4 * cfg.image_size, max_image_size=cfg.image_size)
    tok = model.tokenizer
    pieces = _placeholder_pieces(text, idefics3.PLACEHOLDER, len(images))
    tiled = [idefics3_tiles(im, rules, f"image {i}") for i, im in enumerate(images)]
    ids = _text_ids(tok, pieces[0])
    for (tiles, rows, cols), piece in zip(tiled, pieces[1:]):
        for seg in idefics3.prompt_segments(cfg, rows, cols):
            ids += _text_ids(tok, seg) if isinstance(seg, str) else [cfg.image_token_index] * seg
        ids += _text_ids(tok, piece)
    try:
        spans = idefics3.image_token_runs(ids, cfg, [t.shape[0] for t, _, _ in tiled])
    except ValueError as e:  # e.g. an <image> token written in a text part
        raise ImageError(str(e)) from e
    pixels = [t for t, _, _ in tiled]
    digests = tuple(hashlib.sha256(np.ascontiguousarray(p).tobytes()).hexdigest() for p in pixels)
    per_tile = [b - a for a, b in spans]  # (one run per tile, images in order)
    counts, at = [], 0
    for p in pixels:
        counts.append(sum(per_tile[at:at + p.shape[0]]))
        at += p.shape[0]
    return ImagePrompt(ids, _encode(vision, pixels, digests, cache), spans, digests, tuple(counts))


def _qwen2_vl_prompt(model: Any, vision: Any, text: str, images: list[Any], cache: EncoderCache | None) -> ImagePrompt:
    """Qwen2(.5)-VL's `image_prompt_from_text`: each "<|vision_start|><|image_pad|><|vision_end|>"
    becomes vision_start + t * h * w / merge^2 image tokens + vision_end (Qwen2_5_VLProcessor's
    expansion; the text between tokenized piece by piece), the images preprocessed
    (loading/images_qwen2_vl.py) and encoded one by one, and the prompt's M-RoPE offsets
    (core/vision/qwen2_vl.rope_offsets). Qwen3-VL's likewise (its module re-exports these),
    with its DeepStack rows."""
    qwen2_vl = _vision_module(vision)  # (qwen2_vl or qwen3_vl: the same prompt side)
    from fx_engine.loading.images_qwen2_vl import Qwen2VLProcessorConfig, preprocess_one

    cfg = vision.config
    rules = model.image_processor
    if not isinstance(rules, Qwen2VLProcessorConfig):
        rules = Qwen2VLProcessorConfig(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                       merge_size=cfg.spatial_merge_size)
    tok = model.tokenizer
    pieces = _placeholder_pieces(text, qwen2_vl.PLACEHOLDER, len(images))
    done = [preprocess_one(im, rules, f"image {i}") for i, im in enumerate(images)]
    grids = [g for _, g in done]
    ids = _text_ids(tok, pieces[0])
    for g, piece in zip(grids, pieces[1:]):
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * cfg.image_tokens(g) + [cfg.vision_end_token_id]
        ids += _text_ids(tok, piece)
    try:
        spans = qwen2_vl.image_token_runs(ids, cfg, grids)
    except ValueError as e:  # e.g. an <|image_pad|> token written in a text part
        raise ImageError(str(e)) from e
    digests = tuple(hashlib.sha256(np.ascontiguousarray(p).tobytes() + repr(g).encode()).hexdigest()
                    for p, g in done)
    offsets, delta = qwen2_vl.rope_offsets(ids, grids, cfg)
    rows, deepstack = _encode_qwen2_vl(vision, done, digests, cache)
    return ImagePrompt(ids, rows, spans, digests, tuple(cfg.image_tokens(g) for g in grids), offsets, delta,
                       deepstack)


def _encode_qwen2_vl(vision: Any, done: Sequence[tuple[np.ndarray, tuple]], digests: Sequence[str],
                     cache: EncoderCache | None) -> tuple[mx.array, mx.array | None]:
    """The images' rows [sum of image tokens, H] and DeepStack rows [L, sum, H] (Qwen3-VL;
    else None), evaluated: each image encoded alone (one compiled trace per image-size bucket; an
    image encodes alike alone or with others) or taken from `cache` (Qwen3-VL's cached as
    one [1 + L, tokens, H] array)."""
    encode = _vision_module(vision).encode_images_compiled

    def one(item: tuple[np.ndarray, tuple]) -> mx.array:
        patches, grid = item
        out = encode(vision, mx.array(patches), [grid])
        if isinstance(out, tuple):  # Qwen3-VL: (rows, deepstack)
            out = mx.concatenate([out[0][None], out[1]], axis=0)
        return out

    have = _encode_each(done, digests, cache, one)
    axis = 1 if have[0].ndim == 3 else 0
    rows = mx.concatenate(have, axis=axis) if len(have) > 1 else have[0]
    mx.eval(rows)  # (the engine's thread reads them)
    if axis == 0:
        return rows, None
    main, deep = mx.contiguous(rows[0]), (mx.contiguous(rows[1:]) if rows.shape[0] > 1 else None)
    mx.eval(main, *([] if deep is None else [deep]))  # (evaluated here too: no lazy slice crosses threads)
    return main, deep


def _special_id(tok: Any, text: str) -> int:
    """The id of a special token string (one id, or ImageError)."""
    ids = list(tok.encode(text, add_special_tokens=False))
    if len(ids) != 1:
        raise ImageError(f"the tokenizer does not have {text} as one token (it encodes to {ids}): the image "
                         "prompt cannot be laid out")
    return int(ids[0])


def _pixtral_prompt(model: Any, vision: Any, text: str, images: list[Any], cache: EncoderCache | None) -> ImagePrompt:
    """Mistral 3's `image_prompt_from_text`: each "[IMG]" becomes rows of "[IMG]" * cols each
    ended by "[IMG_BREAK]", the last by "[IMG_END]" (PixtralProcessor's expansion:
    core/vision/pixtral.py; the text between tokenized piece by piece), the images
    preprocessed (loading/images_pixtral.py) and encoded one size at a time."""
    from fx_engine.core.vision import pixtral
    from fx_engine.loading.images_pixtral import PixtralProcessorConfig, preprocess_one

    cfg = vision.config
    rules = model.image_processor
    if not isinstance(rules, PixtralProcessorConfig):
        rules = PixtralProcessorConfig(longest_edge=cfg.image_size, patch_size=cfg.patch_size,
                                       merge_size=cfg.spatial_merge_size)
    tok = model.tokenizer
    pieces = _placeholder_pieces(text, pixtral.PLACEHOLDER, len(images))
    if _special_id(tok, pixtral.PLACEHOLDER) != cfg.image_token_index:
        raise ImageError(f"the tokenizer's {pixtral.PLACEHOLDER} is not config.json's image_token_index "
                         f"({cfg.image_token_index})")
    brk, end = _special_id(tok, pixtral.BREAK_TEXT), _special_id(tok, pixtral.END_TEXT)
    pixels = [preprocess_one(im, rules, f"image {i}") for i, im in enumerate(images)]
    grids = [cfg.token_grid(p.shape[1], p.shape[2]) for p in pixels]
    ids = _text_ids(tok, pieces[0])
    for (r, c), piece in zip(grids, pieces[1:]):
        ids += pixtral.prompt_ids(cfg, r, c, brk, end) + _text_ids(tok, piece)
    try:
        spans = pixtral.image_token_runs(ids, cfg, grids)
    except ValueError as e:  # e.g. an [IMG] token written in a text part
        raise ImageError(str(e)) from e
    digests = tuple(hashlib.sha256(np.ascontiguousarray(p).tobytes() + repr(p.shape).encode()).hexdigest()
                    for p in pixels)
    have = _encode_each(pixels, digests, cache,
                        lambda p: pixtral.encode_images_compiled(vision, mx.array(p[None]))[0])
    rows = mx.concatenate(have, axis=0) if len(have) > 1 else have[0]
    mx.eval(rows)  # (the engine's thread reads them)
    return ImagePrompt(ids, rows, spans, digests, tuple(r * c for r, c in grids))


def _gemma4_prompt(model: Any, vision: Any, text: str, images: list[Any], cache: EncoderCache | None) -> ImagePrompt:
    """Gemma 4's `image_prompt_from_text`: each "<|image|>" becomes "<|image>" + n image
    tokens + "<image|>" (Gemma4Processor's expansion; n the image's soft tokens), the text
    between tokenized piece by piece, the images preprocessed (loading/images_gemma4.py)
    and encoded one at a time (one compiled trace per size bucket). An image stays in one
    prefill piece where the model's image tokens see each other (`use_bidirectional_attention`
    "vision")."""
    from fx_engine.core.vision import gemma4
    from fx_engine.loading.images_gemma4 import Gemma4ProcessorConfig, preprocess_one

    cfg = vision.config
    rules = model.image_processor
    if not isinstance(rules, Gemma4ProcessorConfig):
        rules = Gemma4ProcessorConfig(patch_size=cfg.patch_size, pooling_kernel_size=cfg.pooling_kernel_size)
    tok = model.tokenizer
    pieces = _placeholder_pieces(text, gemma4.PLACEHOLDER, len(images))
    done = [preprocess_one(im, rules, f"image {i}") for i, im in enumerate(images)]
    counts = [gemma4.image_tokens(cfg, g) for _, g in done]
    ids = _text_ids(tok, pieces[0])
    for n, piece in zip(counts, pieces[1:]):
        ids += [cfg.boi_token_index] + [cfg.image_token_index] * n + [cfg.eoi_token_index] + _text_ids(tok, piece)
    try:
        spans = gemma4.image_token_runs(ids, cfg, counts)
    except ValueError as e:  # e.g. an <|image|> token written in a text part
        raise ImageError(str(e)) from e
    digests = tuple(hashlib.sha256(np.ascontiguousarray(p).tobytes() + repr(g).encode()).hexdigest()
                    for p, g in done)
    have = _encode_each(done, digests, cache,
                        lambda item: gemma4.encode_image_compiled(vision, mx.array(item[0]), item[1]))
    rows = mx.concatenate(have, axis=0) if len(have) > 1 else have[0]
    mx.eval(rows)  # (the engine's thread reads them)
    return ImagePrompt(ids, rows, spans, digests, tuple(counts),
                       whole=bool(getattr(model.config, "vision_bidirectional", False)))


def prefix_key(image: ImagePrompt | None, tokens: Sequence[int]) -> list[int]:
    """The ids a prefix-cache entry of an image prompt is keyed by: `tokens` (a prefix of the
    prompt, or the prompt and its reply) with each image's tokens replaced by negative ids
    drawn from its content digest (31 bits of it per token, the digest's 256 bits cycling
    over the image's tokens). So a follow-up turn with the same images, or with more images
    after them, reuses the KV up to where its content first differs (vLLM keys its blocks by
    the images' hashes likewise); other pixels never match, and text before the first image
    is shared with any prompt. Text-only requests: `tokens` as they are.

    An M-RoPE prompt (Qwen2(.5)-VL) with a rope_delta stores its keys rotated by ids
    shifted by -delta (core/vision/qwen2_vl.py's docstring), so its first token is marked
    by the delta too: entries are shared only between prompts of the same delta (a
    follow-up turn without new images), never with text-only ones."""
    if image is None:
        return list(tokens)
    key = list(tokens)
    if image.rope_delta and key:
        h = hashlib.sha256(f"mrope:{image.rope_delta}:{key[0]}".encode()).hexdigest()
        key[0] = -1 - int(h[:8], 16) % (2**31 - 1)
    positions = [p for a, b in image.spans for p in range(a, b) if p < len(key)]
    at = 0
    for digest, n in zip(image.digests, image.image_tokens, strict=True):
        marks = [-1 - int(digest[i:i + 8], 16) % (2**31 - 1) for i in range(0, len(digest), 8)]
        for j, p in enumerate(positions[at:at + n]):
            key[p] = marks[j % len(marks)]
        at += n
    return key


def whole_images(image: ImagePrompt, start: int, n: int) -> int:
    """The most tokens <= n a prefill piece from `start` may take without cutting an image
    run where the family needs whole runs (`ImagePrompt.whole`; else n) (0: not even one: a
    run starts at `start` and is longer than n)."""
    if not image.whole:
        return n
    end = start + n
    for a, b in image.spans:
        if a < end < b:
            return max(0, a - start)
    return n


def step_images(pieces: Sequence[tuple[Any, int, int]], token_index: int) -> Any:
    """A prefill call's `ImageInput` (None when no piece holds an image token, nor a token
    whose M-RoPE ids are not its cache position): pieces are (request, start, n) per row, a
    request's `image` its ImagePrompt or None. The rows of every image request of the call
    are stacked (padded to a power of two of rows, so calls compile per bucket); each row
    starts at its request's rows + the image tokens before `start`. M-RoPE requests'
    offsets (`ImagePrompt.rope_offsets`) are stacked likewise (a power of two of columns),
    each row reading from its request's offsets at `start`; other rows none."""
    from fx_engine.core.buckets import pow2_ceil
    from fx_engine.core.vision.splice import ImageInput

    parts, starts, used, offset = [], [], False, 0
    tables, pos_starts, columns, deep = [], [], 0, []
    for req, start, n in pieces:
        ip = getattr(req, "image", None)
        if ip is None or ip.rope_offsets is None:
            pos_starts.append(-1)
        else:
            pos_starts.append(columns + start)
            tables.append(np.asarray(ip.rope_offsets, np.int32))
            columns += tables[-1].shape[1]
            used = used or start < ip.rope_until
        if ip is None:
            starts.append(0)
            continue
        starts.append(offset + sum(min(b, start) - a for a, b in ip.spans if a < start))
        parts.append(ip.rows)
        deep.append(getattr(ip, "deepstack", None))
        offset += int(ip.rows.shape[0])
        used = used or any(a < start + n and start < b for a, b in ip.spans)
    if not used:
        return None
    rows = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    pad = pow2_ceil(offset, 16) - offset
    if pad:
        rows = mx.concatenate([rows, mx.zeros((pad, rows.shape[1]), rows.dtype)], axis=0)
    pos = {}
    if tables:
        table = np.zeros((3, pow2_ceil(columns, 64)), np.int32)
        table[:, :columns] = np.concatenate(tables, axis=1)
        pos = {"positions": mx.array(table), "position_start": mx.array(pos_starts, mx.int32)}
    if any(d is not None for d in deep):  # Qwen3-VL's DeepStack rows, parallel to the rows
        stack = mx.concatenate(deep, axis=1) if len(deep) > 1 else deep[0]
        if pad:
            stack = mx.concatenate([stack, mx.zeros((stack.shape[0], pad, stack.shape[2]), stack.dtype)], axis=1)
        pos["deepstack"] = stack
    return ImageInput(rows=rows, start=mx.array(starts, mx.int32), token_index=token_index, **pos)


def prompt_step_images(image: ImagePrompt | None, start: int, n: int, token_index: int) -> Any:
    """`step_images` of one prompt's prefill piece [start, start + n) (the reference loop's)."""
    holder = collections.namedtuple("Piece", "image")(image)
    return step_images([(holder, start, n)], token_index)


def _mrope_model(model: Any) -> bool:
    """Whether `model` places its image tokens at M-RoPE positions (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL: its tower's model_type, or its text config's mrope_section)."""
    from fx_engine.core.vision import qwen2_vl, qwen3_vl

    return (getattr(model.vision.config, "model_type", None) in (*qwen2_vl.MODEL_TYPES, *qwen3_vl.MODEL_TYPES)
            or bool(getattr(model.config, "mrope_section", ())))


def portable(image: ImagePrompt) -> dict[str, Any]:
    """An ImagePrompt as plain data (numpy arrays, their MLX dtypes by name): what a lockstep
    engine's rank 0 sends the other ranks with the request (engine/lockstep.RequestRecord),
    so they splice the same rows without encoding the images again."""
    def plain(x: Any) -> Any:
        if x is None or not isinstance(x, mx.array):
            return x  # (None, or already numpy: M-RoPE offsets)
        return (str(x.dtype).split(".")[-1], np.asarray(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x))

    return {**image._asdict(), "rows": plain(image.rows), "deepstack": plain(image.deepstack),
            "rope_offsets": plain(image.rope_offsets)}


def from_portable(data: dict[str, Any]) -> ImagePrompt:
    """`portable`'s inverse: the same ImagePrompt, its arrays bit for bit (bfloat16 travels
    as float32, which holds it exactly)."""
    def array(x: Any) -> Any:
        return mx.array(x[1]).astype(getattr(mx, x[0])) if isinstance(x, tuple) else x

    return ImagePrompt(**{**data, "rows": array(data["rows"]), "deepstack": array(data["deepstack"]),
                          "rope_offsets": array(data["rope_offsets"])})


def engine_image_prompt(model: Any, messages: Any, *,
                        prefill_chunk: int, step_token_budget: int, max_rows: int,
                        cache: EncoderCache | None) -> ImagePrompt:
    """An Engine's image request: its prompt and image rows (`image_prompt`, or an
    `ImagePrompt` the caller made), after the refusals of a hand-made ImagePrompt without what its model reads (Qwen3-VL's DeepStack rows,
    Qwen-VL's M-RoPE offsets), and the check that a whole image fits one prefill piece of
    this engine."""
    from fx_engine.engine import scheduler as sched

    # (prompt_logprobs and max_tokens=0 score through score_step with the image rows; every
    # drafter composes: learned heads read the states the prefill steps capture with the
    # rows spliced in, and embed the prompt's ids, image placeholders included)
    if isinstance(messages, ImagePrompt):
        image = messages
        if model.vision is None:
            raise ValueError("images: this engine's model has no vision tower")
        if getattr(model.vision.config, "deepstack_visual_indexes", ()) and image.deepstack is None:
            raise ValueError("images: this Qwen3-VL model's ImagePrompt needs its DeepStack rows "
                             "(ImagePrompt.deepstack: make it with image_prompt / image_prompt_from_text)")
        if _mrope_model(model) and image.rope_offsets is None:
            # (without them its image tokens would run at plain RoPE positions, not the model's)
            raise ValueError("images: this Qwen-VL model's ImagePrompt needs its M-RoPE position offsets "
                             "(ImagePrompt.rope_offsets: make it with image_prompt / image_prompt_from_text)")
        # (a hand-made prompt for Gemma 3, or a Gemma 4 whose image tokens see each other,
        # still keeps its images whole)
        image = image._replace(whole=image.whole or model.vision.config.model_type == "gemma3"
                               or bool(getattr(model.config, "vision_bidirectional", False)))
    else:
        image = image_prompt(model, messages, cache=cache)
    run = max(b - a for a, b in image.spans)  # (images may differ in size: the largest)
    if image.whole and (run > prefill_chunk or sched.chunk_bucket(run) > step_token_budget - max_rows):
        fewer = (" (or give the images fewer pixels: preprocessor_config.json's max_pixels)"
                 if image.rope_offsets is not None else "")
        raise ValueError(f"images: an image is {run} tokens; a prefill piece holds whole images, so the "
                         f"engine's prefill_chunk ({prefill_chunk}) must be >= {run} and its "
                         f"step_token_budget ({step_token_budget}) >= max_rows + {sched.chunk_bucket(run)}{fewer}")
    return image
