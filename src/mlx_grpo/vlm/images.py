"""Images for vision-language prompts: read from a file path, raw bytes or a `datasets` Image feature value
({"bytes": ..., "path": ...} or a PIL image), each as RGB; a missing or unreadable image is one UserError line."""

from __future__ import annotations

import io
from pathlib import Path


def load_image(source, base_dir: Path | None = None, where: str = "image"):
    """A PIL RGB image from a path (relative ones under base_dir), bytes, a {"bytes", "path"} dict or a PIL
    image; where: what to name in the error."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, dict):  # the datasets Image feature, undecoded
        if source.get("bytes"):
            source = source["bytes"]
        elif source.get("path"):
            source = source["path"]
        else:
            raise _error(where, "an image dict with neither bytes nor path")
    if isinstance(source, (bytes, bytearray)):
        try:
            return Image.open(io.BytesIO(source)).convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise _error(where, f"unreadable image bytes ({exc})") from None
    if not isinstance(source, (str, Path)):
        raise _error(where, f"expected an image path, bytes or image, got {type(source).__name__}")
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise _error(where, f"image not found: {path}")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise _error(where, f"unreadable image {path} ({type(exc).__name__})") from None


def image_name(source) -> str:
    """How logs name an image: its path, else '<bytes:N>'."""
    if isinstance(source, dict):
        return str(source.get("path") or f"<bytes:{len(source.get('bytes') or b'')}>")
    if isinstance(source, (bytes, bytearray)):
        return f"<bytes:{len(source)}>"
    return str(source) if isinstance(source, (str, Path)) else f"<{type(source).__name__}>"


def _error(where: str, message: str):
    from mlx_grpo.base.errors import UserError

    return UserError(f"{where}: {message}")
